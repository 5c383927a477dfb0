//! Issue 19, "refuse bad recipes before any work": every out-of-range key is refused by
//! `parse_recipe` (parse time, before a model exists), and the error names the file, the key and
//! the allowed range.

use std::path::Path;

use composer_train::recipe::{parse_recipe, EMBEDDED_DEFAULT_RECIPE};

mod later_failures;

/// The default recipe with `line` inserted right after the `[section]` header.
fn with_key(section: &str, line: &str) -> String {
    let header = format!("[{section}]");
    let key = line.split('=').next().unwrap().trim();
    let mut out = Vec::new();
    let mut found = false;
    let mut current = String::new();
    for l in EMBEDDED_DEFAULT_RECIPE.lines() {
        if l.trim().starts_with('[') {
            current = l.trim().to_string();
        }
        // Drop the default's own value of the same key so the TOML stays valid.
        let same_key = current == header && l.split('=').next().map(str::trim) == Some(key);
        if !same_key {
            out.push(l.to_string());
        }
        if l.trim() == header && !found {
            found = true;
            out.push(line.to_string());
        }
    }
    assert!(found, "no [{section}] in the default recipe");
    out.join("\n")
}

/// Parses `text` as `bad.toml` and returns the error (Display, not the `{:#}` chain: the first
/// line a user sees must already say everything).
fn refusal(text: &str) -> String {
    match parse_recipe(text, Path::new("recipes/bad.toml")) {
        Ok(_) => panic!("recipe accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

/// Parses `text` as `recipes/bad.toml` and returns the whole error chain.
fn chain(text: &str) -> String {
    match parse_recipe(text, Path::new("recipes/bad.toml")) {
        Ok(_) => panic!("recipe accepted:\n{text}"),
        Err(e) => format!("{e:#}"),
    }
}

/// Asserts the refusal names the file, the key and every `allowed` fragment.
fn assert_refused(section: &str, line: &str, key: &str, allowed: &[&str]) {
    let err = refusal(&with_key(section, line));
    assert!(err.contains("recipes/bad.toml"), "no file in: {err}");
    assert!(err.contains(key), "no key {key} in: {err}");
    for a in allowed {
        assert!(err.contains(a), "no {a:?} in: {err}");
    }
}

#[test]
fn default_recipe_still_parses() {
    parse_recipe(EMBEDDED_DEFAULT_RECIPE, Path::new("d.toml")).unwrap();
}

#[test]
fn negative_learning_rate_is_refused() {
    assert_refused("optimizer", "lr = -1e-4", "[optimizer] lr", &[">= 0"]);
    assert_refused("warmup", "lr = -0.1", "[warmup] lr", &[">= 0"]);
    assert_refused("optimizer", "lr = nan", "[optimizer] lr", &[">= 0"]);
}

#[test]
fn negative_weight_decay_is_refused() {
    assert_refused(
        "optimizer",
        "weight_decay = -0.01",
        "[optimizer] weight_decay",
        &[">= 0"],
    );
}

#[test]
fn adam_betas_outside_0_1_are_refused() {
    for betas in ["[1.0, 0.999]", "[0.9, 1.5]", "[-0.1, 0.999]"] {
        assert_refused(
            "optimizer",
            &format!("betas = {betas}"),
            "[optimizer] betas",
            &["[0, 1)"],
        );
    }
    // 0 is allowed (no momentum).
    parse_recipe(
        &with_key("optimizer", "betas = [0.0, 0.5]"),
        Path::new("ok.toml"),
    )
    .unwrap();
}

#[test]
fn zero_max_completion_length_is_refused() {
    assert_refused(
        "rollout",
        "max_completion_length = 0",
        "[rollout] max_completion_length",
        &[">= 1"],
    );
}

#[test]
fn top_p_outside_0_1_is_refused() {
    for top_p in ["0.0", "1.5", "-0.5"] {
        assert_refused(
            "rollout",
            &format!("top_p = {top_p}"),
            "[rollout] top_p",
            &["(0, 1]"],
        );
    }
    parse_recipe(&with_key("rollout", "top_p = 1.0"), Path::new("ok.toml")).unwrap();
}

#[test]
fn min_p_outside_0_1_is_refused() {
    for min_p in ["1.5", "-0.1", "nan"] {
        assert_refused(
            "rollout",
            &format!("min_p = {min_p}"),
            "[rollout] min_p",
            &["[0, 1]"],
        );
    }
    let r = parse_recipe(&with_key("rollout", "min_p = 0.05"), Path::new("ok.toml")).unwrap();
    assert_eq!(r.rollout.min_p, 0.05);
}

#[test]
fn negative_temperature_is_refused() {
    assert_refused(
        "rollout",
        "temperature = -0.5",
        "[rollout] temperature",
        &[">= 0"],
    );
}

#[test]
fn one_generation_with_group_advantage_is_refused() {
    let err = refusal(&with_key("rollout", "num_generations = 1"));
    assert!(err.contains("recipes/bad.toml"), "{err}");
    assert!(err.contains("[rollout] num_generations"), "{err}");
    assert!(err.contains("grpo") && err.contains(">= 2"), "{err}");
    // Batch-normalised REINFORCE++ has no group: G = 1 is fine there.
    let text = with_key("rollout", "num_generations = 1").replace(
        "loss_type = \"dapo\"",
        "loss_type = \"dapo\"\nestimator = \"reinforce_plus_plus\"",
    );
    parse_recipe(&text, Path::new("ok.toml")).unwrap();
}

#[test]
fn empty_verifiers_are_refused() {
    let text = EMBEDDED_DEFAULT_RECIPE.replace(
        "verifiers = [{ kind = \"numeric\", weight = 1.0 }]",
        "verifiers = []",
    );
    assert_ne!(text, EMBEDDED_DEFAULT_RECIPE);
    let err = refusal(&text);
    assert!(err.contains("recipes/bad.toml"), "{err}");
    assert!(
        err.contains("[data] verifiers") && err.contains("at least one"),
        "{err}"
    );
}

#[test]
fn task_and_dataset_both_set_is_refused() {
    assert_refused(
        "data",
        "dataset = \"train.jsonl\"",
        "[data] dataset",
        &["[data] task", "exactly one"],
    );
}

#[test]
fn zero_eval_size_is_refused() {
    assert_refused("data", "eval_size = 0", "[data] eval_size", &[">= 1"]);
}

/// The replay channel's new keys parse (TRL's names and values) and a wrong value names the key.
#[test]
fn replay_dpo_loss_type_and_kl_aggregation_keys() {
    let text = with_key(
        "loss.replay",
        "dpo_loss_type = \"ipo\"\nkl_loss_agg_mode = \"token-mean\"",
    );
    let r = parse_recipe(&text, Path::new("ok.toml")).unwrap();
    assert_eq!(r.loss.replay.dpo_loss_type, composer_loss::DpoLossType::Ipo);
    assert_eq!(
        r.loss.replay.kl_loss_agg_mode,
        composer_loss::DistillationAgg::TokenMean
    );
    let err = format!(
        "{:#}",
        parse_recipe(
            &with_key("loss.replay", "dpo_loss_type = \"sigmoidd\""),
            Path::new("recipes/bad.toml")
        )
        .unwrap_err()
    );
    // serde names the bad value and the allowed variants.
    assert!(err.contains("sigmoidd") && err.contains("hinge"), "{err}");
    let hint = with_key("loss.hint", "loss_agg_mode = \"token-mean\"");
    let r = parse_recipe(&hint, Path::new("ok.toml")).unwrap();
    assert_eq!(
        r.loss.hint.config.loss_agg_mode,
        composer_loss::DistillationAgg::TokenMean
    );
}

#[test]
fn token_budget_below_one_completion_is_refused() {
    // The default recipe's max_completion_length is 5.
    assert_refused(
        "train",
        "max_tokens_per_microbatch = 4",
        "[train] max_tokens_per_microbatch",
        &["= 4", ">= `[rollout] max_completion_length` (5)"],
    );
    parse_recipe(
        &with_key("train", "max_tokens_per_microbatch = 5"),
        Path::new("ok.toml"),
    )
    .unwrap();
}

#[test]
fn repo_agent_recipe_parses_and_tool_keys_are_checked() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../recipes/repo_agent.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let r = parse_recipe(&text, &path).unwrap();
    let env = r.env.as_ref().unwrap();
    assert_eq!(env.kind, "openenv_tools");
    assert!(env.chat_template.is_some() && env.system_prompt.is_some());
    // Text templates would corrupt chat-rendered observations.
    let bad = text.replace(
        "kind = \"openenv_tools\"",
        "kind = \"openenv_tools\"\nprompt_template = \"Task: {observation}\"",
    );
    let err = format!(
        "{:#}",
        parse_recipe(&bad, Path::new("recipes/bad.toml")).unwrap_err()
    );
    assert!(
        err.contains("[env] prompt_template") && err.contains("openenv_tools"),
        "{err}"
    );
    // Tool keys on a text-action server are refused by name.
    let bad = text.replace("kind = \"openenv_tools\"", "kind = \"openenv\"");
    let err = format!(
        "{:#}",
        parse_recipe(&bad, Path::new("recipes/bad.toml")).unwrap_err()
    );
    assert!(err.contains("[env] chat_template"), "{err}");
    let bad = text.replace("kind = \"openenv_tools\"", "kind = \"mcp\"");
    let err = format!(
        "{:#}",
        parse_recipe(&bad, Path::new("recipes/bad.toml")).unwrap_err()
    );
    assert!(err.contains("openenv_tools"), "{err}");
}

#[test]
fn grpo_passk_and_remax_settings_they_cannot_honour_are_refused() {
    // Pass@k needs a group (verl asserts at least 2 samples per group).
    let text = with_key("rollout", "num_generations = 1")
        .replace("[loss]", "[loss]\nestimator = \"grpo_passk\"");
    let err = refusal(&text);
    assert!(
        err.contains("[rollout] num_generations") && err.contains("grpo_passk"),
        "{err}"
    );
    let err = refusal(
        &with_key("loss", "estimator = \"grpo_passk\"")
            .replace("scale_rewards = \"group\"", "scale_rewards = \"batch\""),
    );
    assert!(
        err.contains("[loss] scale_rewards") && err.contains("\"none\""),
        "{err}"
    );
    // ReMax has no group constraint (verl has none): one generation per prompt is fine.
    let text = with_key("rollout", "num_generations = 1")
        .replace("[loss]", "[loss]\nestimator = \"remax\"");
    parse_recipe(&text, Path::new("ok.toml")).unwrap();
    let err = refusal(&with_key("loss", "estimator = \"remax\"").replace(
        "[loss]",
        "[loss]\nmulti_objective_aggregation = \"normalize_then_sum\"",
    ));
    assert!(err.contains("[loss] multi_objective_aggregation"), "{err}");
    // No greedy baseline episodes with `[env]`.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../recipes/repo_agent.toml");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("[loss]", "[loss]\nestimator = \"remax\"");
    let err = refusal(&text);
    assert!(
        err.contains("[loss] estimator") && err.contains("[env]") && err.contains("greedy"),
        "{err}"
    );
}

#[test]
fn cuda_graphs_with_async_actors_on_a_gpu_is_refused() {
    let graphs = with_key("rollout", "cuda_graphs = true");
    let on_gpu = graphs.replace(
        "[model.builtin_tiny]",
        "[model]\ndevice = \"cuda\"\n\n[model.builtin_tiny]",
    );
    let text = on_gpu.replace("[train]\n", "[train]\nmode = \"async\"\n");
    let err = match parse_recipe(&text, Path::new("recipes/bad.toml")) {
        Ok(_) => panic!("recipe accepted:\n{text}"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("recipes/bad.toml"), "no file in: {err}");
    for key in ["[rollout] cuda_graphs", "[train] mode", "cuda"] {
        assert!(err.contains(key), "no {key:?} in: {err}");
    }
    // Sync mode on the GPU, and async on the CPU (no capture there), parse.
    parse_recipe(&on_gpu, Path::new("ok.toml")).unwrap();
    parse_recipe(
        &graphs.replace("[train]\n", "[train]\nmode = \"async\"\n"),
        Path::new("ok.toml"),
    )
    .unwrap();
}
