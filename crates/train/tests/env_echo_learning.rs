//! The built-in tiny model trained for a few steps against the REAL OpenEnv echo server
//! (openenv-core 0.3.0, reward = 0.1 × len(message), started by
//! ../shared/openenv/start-server.sh; `OPENENV_URL` names it: unset → SKIPPED, or a failure
//! under `CI`). The only way up is to say longer messages: stop emitting end-of-text (and the
//! special tokens, which decode to nothing) before the 12-token limit. Mean reward must rise.

use std::path::Path;

use composer_telemetry::read_metrics;
use composer_train::TrainOptions;

mod common;
use common::{tiny_model_and_task, train_quietly};

const RECIPE: &str = concat!(
    tiny_model_and_task!(),
    r#"
[rollout]
num_generations = 8
max_completion_length = 12
temperature = 1.0

[loss]
scale_rewards = "group"

[optimizer]
lr = 3e-2

[train]
steps = 10
prompts_per_step = 4
seed = 3
eval_every = 0
checkpoint_every = 0

[env]
kind = "openenv"
url_env = "OPENENV_URL"
max_turns = 1
max_concurrent = 4
call_timeout_s = 30.0
episode_timeout_s = 90.0
"#
);

fn skip_or_fail() -> bool {
    if std::env::var("OPENENV_URL").is_ok_and(|u| !u.trim().is_empty()) {
        return false;
    }
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
    assert!(
        !ci,
        "OPENENV_URL is unset but CI is set (start ../shared/openenv/start-server.sh)"
    );
    eprintln!("SKIPPED: env_echo_learning: OPENENV_URL is unset (start ../shared/openenv/start-server.sh and export it)");
    true
}

fn mean_rewards(run_dir: &Path) -> Vec<f64> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|r| r["kind"] == "train")
        .map(|r| r["reward/mean"].as_f64().unwrap())
        .collect()
}

#[test]
fn tiny_model_learns_the_real_echo_env() {
    if skip_or_fail() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("recipe.toml");
    std::fs::write(&recipe, RECIPE).unwrap();
    let run_dir = dir.path().join("run");
    let outcome = train_quietly(&recipe, &run_dir).unwrap();
    assert_eq!(outcome.steps_completed, 10);
    let rewards = mean_rewards(&run_dir);
    eprintln!("mean reward per step: {rewards:.3?}");
    assert_eq!(rewards.len(), 10);
    // Each sample's reward is 0.1 × its message length, at most 0.1 × 12.
    assert!(rewards.iter().all(|r| (0.0..=1.2 + 1e-9).contains(r)));
    let first = (rewards[0] + rewards[1]) / 2.0;
    let last = (rewards[8] + rewards[9]) / 2.0;
    assert!(
        last > first + 0.1,
        "mean reward did not rise: first two steps {first:.3}, last two {last:.3} ({rewards:.3?})"
    );
    // The env wall (τ_V) is in the metrics: call latency percentiles and episode counts.
    let lines = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    let last_train = lines.iter().rev().find(|l| l["kind"] == "train").unwrap();
    let p50 = last_train["env/step_p50_s"].as_f64().unwrap();
    let p95 = last_train["env/step_p95_s"].as_f64().unwrap();
    assert!(p50 > 0.0 && p50 <= p95, "{last_train}");
    assert!(last_train["env/episodes_ok"].as_u64().unwrap() > 0);
    assert_eq!(last_train["env/episodes_failed"], 0);
}

#[test]
fn env_section_errors_name_the_key() {
    let bad = |from: &str, to: &str| {
        let text = RECIPE.replace(from, to);
        format!(
            "{:#}",
            composer_train::parse_recipe(&text, Path::new("r.toml")).unwrap_err()
        )
    };
    let e = bad("max_concurrent = 4", "max_concurent = 4");
    assert!(
        e.contains("[env] max_concurent") && e.contains("max_concurrent"),
        "{e}"
    );
    let e = bad("kind = \"openenv\"", "kind = \"gym\"");
    assert!(
        e.contains("[env] kind") && e.contains("builtin, openenv"),
        "{e}"
    );
    let e = bad("url_env = \"OPENENV_URL\"", "");
    assert!(e.contains("[env] url"), "{e}");
    let e = bad("call_timeout_s = 30.0", "call_timeout_s = 0.0");
    assert!(e.contains("[env] call_timeout_s"), "{e}");
    let e = bad("kind = \"openenv\"", "kind = \"builtin\"\nname = \"chess\"");
    assert!(e.contains("[env] name") && e.contains("code, echo"), "{e}");
    // A built-in env recipe parses.
    let ok = RECIPE.replace(
        "kind = \"openenv\"\nurl_env = \"OPENENV_URL\"",
        "kind = \"builtin\"\nname = \"code\"",
    );
    let r = composer_train::parse_recipe(&ok, Path::new("r.toml")).unwrap();
    assert_eq!(r.env.unwrap().name.as_deref(), Some("code"));
}

/// A 3-turn episode of the real tiny policy in the built-in echo env: model tokens are
/// exactly what the policy sampled in that context (their recorded sampler log-probs equal the
/// model's teacher-forced log-probs over the final sequence), observations are the template's
/// tokens, masked out, and nothing is re-tokenised.
#[test]
fn multi_turn_episode_is_token_faithful() {
    use candle_core::Device;
    use composer_env::{run_episode, EchoEnv, EpisodeConfig, EpisodeEnd, ResetOptions};
    use composer_model::SamplingParams;
    use composer_train::batch::{token_batch, token_stats};
    use composer_train::env_rollout::{with_turn_sampler, ModelTurnPolicy};
    use composer_train::model::{PolicyModel, TinyConfig};
    use composer_train::tokenizer::{build_char_tokenizer, encode, token_id, EOS_TOKEN};

    let tok =
        build_char_tokenizer(["Echo Env environment ready![]abcdefghijklmnopqrstuvwxyz"]).unwrap();
    let cfg: TinyConfig = toml::from_str(
        "hidden_size = 16\nlayers = 1\nheads = 2\nkv_heads = 1\nintermediate_size = 32",
    )
    .unwrap();
    let eos = token_id(&tok, EOS_TOKEN).unwrap();
    let model_cfg = cfg.model_config(tok.get_vocab_size(true), eos).unwrap();
    let model = PolicyModel::random_init(&model_cfg, 5, &Device::Cpu).unwrap();
    let params = SamplingParams {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_new_tokens: 6,
        stop_token_ids: Some(vec![eos]),
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (ep, fed) = with_turn_sampler(&model, params, 3, 1000, |sampler| {
        let mut policy =
            ModelTurnPolicy::new(sampler, &tok, 11, "{observation}\n", "[{observation}]\n");
        let mut env = EchoEnv::new();
        let ep = rt
            .block_on(run_episode(
                &mut policy,
                &mut env,
                ResetOptions::default(),
                &EpisodeConfig {
                    max_turns: 3,
                    max_total_tokens: 200,
                },
            ))
            .unwrap();
        ep
    })
    .unwrap();
    assert_eq!(ep.end, EpisodeEnd::MaxTurns);
    assert_eq!(ep.turns.len(), 3);
    let prompt = encode(&tok, "Echo Env environment ready!\n").unwrap();
    assert_eq!(&ep.token_ids[..ep.prompt_len], prompt.as_slice());
    for (k, turn) in ep.turns.iter().enumerate() {
        assert!(!turn.model_tokens.is_empty());
        for p in turn.model_tokens.clone() {
            assert_eq!((ep.loss_mask[p], ep.policy_versions[p]), (1, 3));
        }
        let echoed = turn.action_text.clone();
        assert_eq!(turn.action, Some(serde_json::json!({ "message": echoed })));
        assert!((turn.reward - 0.1 * echoed.chars().count() as f64).abs() < 1e-9);
        if k < 2 {
            let obs = &ep.token_ids[turn.observation_tokens.clone()];
            assert_eq!(
                obs,
                encode(&tok, &format!("[{echoed}]\n")).unwrap().as_slice()
            );
            for p in turn.observation_tokens.clone() {
                assert_eq!((ep.loss_mask[p], ep.sampler_logprobs[p]), (0, 0.0));
            }
        } else {
            assert!(turn.observation_tokens.is_empty());
        }
    }
    // Teacher-forced log-probs of the whole sequence (temperature 1 = the sampling one).
    let (p, c) = ep.token_ids.split_at(ep.prompt_len);
    let tb = token_batch(&[(p, c)], eos, &Device::Cpu).unwrap();
    let lp = token_stats(&model, &tb, 1.0, None, 0).unwrap().logprobs;
    let lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
    let mut checked = 0;
    for (k, &pos) in tb.completion_positions[0].iter().enumerate() {
        let at = ep.prompt_len + k;
        if ep.loss_mask[at] == 1 {
            assert!(
                (lp[pos] - ep.sampler_logprobs[at]).abs() < 1e-4,
                "token {at}: teacher-forced {} vs sampled {}",
                lp[pos],
                ep.sampler_logprobs[at]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, ep.loss_mask.iter().filter(|m| **m == 1).count());
    // Turns 2 and 3 continued from the previous turn's KV: only its last sampled token and
    // the observation were prefilled, not the whole context.
    let observations: usize = ep.turns[..2]
        .iter()
        .map(|t| t.observation_tokens.len())
        .sum();
    let turn_starts: usize = ep.turns.iter().map(|t| t.model_tokens.start).sum();
    assert_eq!(fed.context_tokens, turn_starts);
    assert_eq!(fed.prefill_tokens, ep.prompt_len + 2 + observations);
}

/// The example recipes in `recipes/` parse (the OpenEnv one names its server by `url_env`,
/// resolved only when training starts).
#[test]
fn example_env_recipes_parse() {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../recipes"));
    for name in ["openenv_echo.toml", "code_env.toml"] {
        let r = composer_train::load_recipe(&dir.join(name))
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert!(r.env.is_some(), "{name} has no [env]");
    }
}

/// An echo env whose `step` fails (as a dropped connection would) in every `fail_every`-th
/// episode (counted over all envs of the factory, by reset); with `fail_every = 1` a server
/// that is down: every call fails, `reset` included.
struct FlakyEcho {
    inner: composer_env::EchoEnv,
    resets: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    episode: usize,
    fail_every: usize,
}

#[async_trait::async_trait]
impl composer_env::Env for FlakyEcho {
    async fn reset(
        &mut self,
        opts: composer_env::ResetOptions,
    ) -> Result<composer_env::StepResult, composer_env::EnvError> {
        self.episode = self
            .resets
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.fail_every == 1 {
            // A server that is down answers no call at all: a reset that succeeded would tell
            // the pool the server is up (and its down budget would never run out).
            return Err(composer_env::EnvError::Connection(
                "server closed the WebSocket (code 1012: service restart)".into(),
            ));
        }
        self.inner.reset(opts).await
    }
    async fn step(
        &mut self,
        action: composer_env::Action,
    ) -> Result<composer_env::StepResult, composer_env::EnvError> {
        if self.episode.is_multiple_of(self.fail_every) {
            return Err(composer_env::EnvError::Connection(
                "server closed the WebSocket (code 1012: service restart)".into(),
            ));
        }
        self.inner.step(action).await
    }
    async fn close(&mut self) -> Result<(), composer_env::EnvError> {
        Ok(())
    }
    fn action_schema(&self) -> Option<serde_json::Value> {
        self.inner.action_schema()
    }
}

fn flaky_factory(fail_every: usize) -> composer_env::EnvFactory {
    let resets = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::sync::Arc::new(move || {
        Ok(Box::new(FlakyEcho {
            inner: composer_env::EchoEnv::new(),
            resets: resets.clone(),
            episode: 0,
            fail_every,
        }) as Box<dyn composer_env::Env>)
    })
}

/// Failed episodes are counted by cause and replaced by a peer's copy (the step goes on);
/// when every episode fails the step is an error naming the cause, not a hang or a panic.
#[test]
fn failed_episodes_are_counted_and_replaced() {
    use composer_train::env_rollout::EnvRollout;
    use composer_train::trainer::{open_session, reward_batch, rollout_batch};

    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("recipe.toml");
    let text = RECIPE
        .replace(
            "kind = \"openenv\"\nurl_env = \"OPENENV_URL\"",
            "kind = \"builtin\"\nname = \"echo\"\nepisode_retries = 0",
        )
        .replace("max_concurrent = 4", "max_concurrent = 3");
    std::fs::write(&recipe, text).unwrap();
    let mut s = open_session(&TrainOptions {
        recipe_path: Some(recipe),
        resume: None,
        quiet: true,
        run_dir_override: Some(dir.path().join("run")),
        max_steps_override: None,
        overwrite: false,
    })
    .unwrap();
    let section = s.recipe.env.clone().unwrap();
    s.env_rollout = Some(EnvRollout::with_factory(&section, "flaky", flaky_factory(3)).unwrap());
    let batch = rollout_batch(&s, 1).unwrap();
    let rewards = reward_batch(&s, &batch);
    let env = s.env_rollout.as_ref().unwrap();
    let results = env.last_batch().unwrap();
    let n = 4 * 8;
    assert_eq!(batch.samples.len(), n);
    assert_eq!(rewards.total.len(), n);
    let replaced = results.replaced.iter().filter(|r| **r).count();
    // Episodes 0, 3, 6, ... of 32 fail: 11 of them.
    assert_eq!(replaced, 11);
    let stats = env.stats();
    assert_eq!((stats.episodes_failed, stats.episodes_ok), (11, 21));
    assert_eq!(stats.failures.connection, 11);
    for (i, smp) in batch.samples.iter().enumerate() {
        assert_eq!(smp.group, i / 8);
        assert!(!smp.completion_ids.is_empty() && !smp.prompt_ids.is_empty());
        // Reward = 0.1 × the decoded message length, replaced samples included.
        let len = batch.texts[i].chars().count() as f64;
        assert!((rewards.total[i] - 0.1 * len).abs() < 1e-9);
    }

    // The hint channel's view: the prompt as the model saw it, the env's feedback.
    let hint = env.hint_group(&batch, &rewards, 1, 8).unwrap();
    assert_eq!(hint.len(), 8);
    assert_eq!(hint[0].prompt_text, "Echo Env environment ready!");
    assert_eq!(hint[0].completion_text, batch.texts[8]);
    assert_eq!(hint[0].reward, rewards.total[8]);

    // A server no episode reaches: the step is played again until the pool gives the server
    // up after `server_down_budget_s`, then it is an error naming the budget and the cause.
    let short = composer_train::recipe::EnvSection {
        server_down_budget_s: 1.0,
        ..section
    };
    s.env_rollout = Some(EnvRollout::with_factory(&short, "dead", flaky_factory(1)).unwrap());
    let err = format!("{:#}", rollout_batch(&s, 2).err().unwrap());
    assert!(
        err.contains("server_down_budget") && err.contains("1012"),
        "{err}"
    );
}

/// Multi-turn episodes train: the built-in echo env for 2 turns per episode, the hint channel
/// on (teacher prompts from the env's prompt and feedback). Observation tokens sit inside the
/// completion, masked out of the loss by each sample's `loss_mask`.
#[test]
fn multi_turn_episodes_train_with_observations_masked() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("recipe.toml");
    let text = RECIPE
        .replace("steps = 10", "steps = 3")
        .replace(
            "scale_rewards = \"group\"",
            "scale_rewards = \"group\"\nhint_weight = 1.0",
        )
        .replace(
            "kind = \"openenv\"\nurl_env = \"OPENENV_URL\"\nmax_turns = 1",
            "kind = \"builtin\"\nname = \"echo\"\nmax_turns = 2",
        );
    std::fs::write(&recipe, text).unwrap();
    let run_dir = dir.path().join("run");
    let outcome = train_quietly(&recipe, &run_dir).unwrap();
    assert_eq!(outcome.steps_completed, 3);
    let lines = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    let train: Vec<_> = lines.iter().filter(|l| l["kind"] == "train").collect();
    assert_eq!(train.len(), 3);
    for l in &train {
        assert!(l["loss/rlvr"].as_f64().unwrap().is_finite(), "{l}");
        assert!(l["loss/hint"].as_f64().unwrap().is_finite(), "{l}");
        // Two model turns of up to 12 tokens plus the observation in between.
        assert!(l["completions/mean_length"].as_f64().unwrap() > 12.0, "{l}");
    }
}

/// DAPO dynamic sampling with `[env]` in sync mode (built-in echo env, no server): groups whose
/// rewards all agree are dropped and more episodes are played (new prompt draws and reset
/// seeds per round) until the step's groups are filled; every kept group, whichever round
/// played it, still finds its episodes for the hint channel; the counts reach the metrics.
#[test]
fn dynamic_sampling_with_env_refills_dropped_groups() {
    use composer_train::trainer::{open_session, rollout_and_score};

    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("recipe.toml");
    // Two samples of at most 2 tokens: many groups get equal rewards (0.1 × message length).
    let text = RECIPE
        .replace(
            "kind = \"openenv\"\nurl_env = \"OPENENV_URL\"",
            "kind = \"builtin\"\nname = \"echo\"",
        )
        .replace("num_generations = 8", "num_generations = 2")
        .replace("max_completion_length = 12", "max_completion_length = 2")
        .replace(
            "scale_rewards = \"group\"",
            "scale_rewards = \"group\"\ndynamic_sampling = true\nmax_dynamic_sampling_rounds = 8",
        )
        .replace("steps = 10", "steps = 2");
    std::fs::write(&recipe, &text).unwrap();
    let opts = TrainOptions {
        recipe_path: Some(recipe.clone()),
        resume: None,
        quiet: true,
        run_dir_override: Some(dir.path().join("probe")),
        max_steps_override: None,
        overwrite: false,
    };
    let s = open_session(&opts).unwrap();
    let scored = rollout_and_score(&s, 1).unwrap();
    let g = 2;
    assert!(
        scored.dropped_groups > 0,
        "no group was dropped: the test proves nothing"
    );
    assert!(scored.rounds > 1 && scored.rounds <= 9, "{}", scored.rounds);
    // Filled from later rounds: 4 groups, none with zero reward variance.
    assert_eq!(scored.batch.prompts.len(), 4);
    assert_eq!(scored.batch.samples.len(), 4 * g);
    let env = s.env_rollout.as_ref().unwrap();
    for gi in 0..4 {
        let r = &scored.rewards.total[gi * g..(gi + 1) * g];
        assert!((r[0] - r[1]).abs() > 1e-12, "group {gi}: {r:?}");
        for (j, smp) in scored.batch.samples[gi * g..(gi + 1) * g]
            .iter()
            .enumerate()
        {
            assert_eq!(smp.group, gi);
            // The env reward is 0.1 × the decoded message length.
            let len = scored.batch.texts[gi * g + j].chars().count() as f64;
            assert!((r[j] - 0.1 * len).abs() < 1e-9);
        }
        let hint = env
            .hint_group(&scored.batch, &scored.rewards, gi, g)
            .unwrap_or_else(|| panic!("group {gi}: its episodes were not found"));
        assert_eq!(hint[0].prompt_text, "Echo Env environment ready!");
        assert_eq!(hint[1].completion_text, scored.batch.texts[gi * g + 1]);
        assert_eq!(hint[1].reward, scored.rewards.total[gi * g + 1]);
    }
    drop(s);

    // The whole loop: the counts are in every train line.
    let run_dir = dir.path().join("run");
    let outcome = train_quietly(&recipe, &run_dir).unwrap();
    assert_eq!(outcome.steps_completed, 2);
    let lines = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    let train: Vec<_> = lines.iter().filter(|l| l["kind"] == "train").collect();
    assert_eq!(train.len(), 2);
    assert_eq!(train[0]["dynamic_sampling/rounds"], scored.rounds);
    assert_eq!(
        train[0]["dynamic_sampling/dropped_groups"],
        scored.dropped_groups
    );
}
