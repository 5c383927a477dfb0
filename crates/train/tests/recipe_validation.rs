//! Issue 19, "refuse bad recipes before any work": every out-of-range key is refused by
//! `parse_recipe` (parse time, before a model exists), and the error names the file, the key and
//! the allowed range.

use std::path::Path;

use composer_train::recipe::{parse_recipe, EMBEDDED_DEFAULT_RECIPE};

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

/// Values that used to pass parsing and then panic (`[warmup] batch_size = 0`), abort on an
/// allocation (`kv_block_size` 10¹²), write NaN weights (`eps = 0`), or train on NaN losses or
/// silently switched-off channels: each refused naming its key.
#[test]
fn values_that_broke_runs_later_are_refused_at_parse_time() {
    for (section, line, key) in [
        ("warmup", "batch_size = 0", "[warmup] batch_size"),
        ("warmup", "batch_size = 100000000", "[warmup] batch_size"),
        ("warmup", "hint_fraction = 7.0", "[warmup] hint_fraction"),
        ("warmup", "hint_fraction = nan", "[warmup] hint_fraction"),
        (
            "rollout",
            "kv_block_size = 1000000000000",
            "[rollout] kv_block_size",
        ),
        ("rollout", "num_generations = 100000000", "num_generations"),
        ("train", "prompts_per_step = 1000000000", "prompts_per_step"),
        ("optimizer", "eps = 0.0", "[optimizer] eps"),
        ("optimizer", "eps = -1.0", "[optimizer] eps"),
        (
            "optimizer",
            "max_grad_norm = nan",
            "[optimizer] max_grad_norm",
        ),
        (
            "optimizer",
            "max_grad_norm = -1.0",
            "[optimizer] max_grad_norm",
        ),
        ("loss", "hint_weight = nan", "[loss] hint_weight"),
        ("loss", "replay_weight = -1.0", "[loss] replay_weight"),
        ("loss", "beta = nan", "beta"),
        ("loss", "entropy_coef = nan", "entropy_coef"),
        ("loss", "kl_tau = nan", "kl_tau"),
        ("loss", "adv_tau = -1.0", "adv_tau"),
        ("loss", "sapo_temperature_pos = nan", "sapo_temperature_pos"),
        ("loss", "loss_scale_factor = 0.0", "loss_scale_factor"),
        (
            "loss",
            "sampler_importance_sampling_clip_max = -1.0",
            "sampler_importance_sampling_clip_max",
        ),
        (
            "train",
            "stop_at_accuracy = 5.0",
            "[train] stop_at_accuracy",
        ),
        (
            "train",
            "stop_at_accuracy = nan",
            "[train] stop_at_accuracy",
        ),
        (
            "train",
            "max_nonfinite_steps = 0",
            "[train] max_nonfinite_steps",
        ),
        (
            "replay",
            "teacher_weights = [-5.0]",
            "[replay] teacher_weights",
        ),
    ] {
        let err = chain(&with_key(section, line));
        assert!(
            err.contains("recipes/bad.toml"),
            "{line}: no file in: {err}"
        );
        assert!(err.contains(key), "{line}: no {key} in: {err}");
    }
    // Both clip bounds set, the lower above the upper: nothing would train.
    let text = with_key(
        "loss",
        "sampler_importance_sampling_clip_min = 5.0\nsampler_importance_sampling_clip_max = 1.0",
    );
    let err = chain(&text);
    assert!(
        err.contains("sampler_importance_sampling_clip_min"),
        "{err}"
    );
}

/// Loss options the loss functions checked only at the first step (after the warm-up), some
/// under another key's name: refused at parse time by their recipe keys.
#[test]
fn loss_channel_options_are_checked_at_parse_time() {
    for (section, line, key) in [
        ("loss.replay", "dpo_beta = 0.0", "[loss.replay] dpo_beta"),
        ("loss.replay", "dpo_beta = nan", "[loss.replay] dpo_beta"),
        ("loss.hint", "is_clip = -1.0", "[loss.hint] is_clip"),
        (
            "loss",
            "loss_type = \"vespo\"",
            "sampler_importance_sampling_mode",
        ),
        (
            "loss",
            "reward_weights = [1.0, 2.0]",
            "[loss] reward_weights",
        ),
    ] {
        let err = chain(&with_key(section, line));
        assert!(err.contains(key), "{line}: no {key} in: {err}");
    }
    let jsd = with_key("loss.hint", "divergence = \"jsd\"\nalpha = 5.0");
    let err = chain(&jsd);
    assert!(err.contains("[loss.hint] alpha"), "{err}");
}

/// The arithmetic task lists every operand pair: an `operand_max` below the smallest operand
/// (one problem, silently) and one that makes hundreds of millions of problems are refused.
#[test]
fn arithmetic_operand_ranges_are_bounded() {
    for line in ["operand_max = 5", "operand_max = 9999"] {
        let err = chain(&with_key("data.arithmetic", line));
        assert!(err.contains("operand_max"), "{line}: {err}");
    }
}

/// The loss crate's configs are built and validated at parse time (every float finite and in
/// its range, NaN included), and each error names the file and the recipe's `[section] key`,
/// not composer-loss's field name (the replay's DPO β is not the KL `beta`).
#[test]
fn every_loss_float_is_checked_under_its_recipe_key() {
    for (section, line, key) in [
        ("loss", "beta = nan", "[loss] beta"),
        ("loss", "entropy_coef = nan", "[loss] entropy_coef"),
        ("loss", "kl_tau = nan", "[loss] kl_tau"),
        ("loss", "adv_tau = -1.0", "[loss] adv_tau"),
        (
            "loss",
            "sapo_temperature_pos = nan",
            "[loss] sapo_temperature_pos",
        ),
        (
            "loss",
            "loss_scale_factor = nan",
            "[loss] loss_scale_factor",
        ),
        ("loss", "epsilon = inf", "[loss] epsilon"),
        ("loss", "delta = 0.5", "[loss] delta"),
        ("loss", "kl_clamp = -1.0", "[loss] kl_clamp"),
        ("loss", "clip_cov_ratio = nan", "[loss] clip_cov_ratio"),
        ("loss", "std_epsilon = -1.0", "[loss] std_epsilon"),
        ("loss", "std_epsilon = nan", "[loss] std_epsilon"),
        ("loss", "reward_weights = [nan]", "[loss] reward_weights"),
        ("loss.hint", "alpha = 5.0", "[loss.hint] alpha"),
        ("loss.hint", "alpha = nan", "[loss.hint] alpha"),
        ("loss.hint", "is_clip = nan", "[loss.hint] is_clip"),
        ("loss.replay", "dpo_beta = nan", "[loss.replay] dpo_beta"),
        ("loss.replay", "dpo_beta = -1.0", "[loss.replay] dpo_beta"),
        (
            "loss.replay",
            "dpo_weight = nan",
            "[loss.replay] dpo_weight",
        ),
        ("loss.replay", "kl_weight = -1.0", "[loss.replay] kl_weight"),
    ] {
        let err = chain(&with_key(section, line));
        assert!(
            err.contains("recipes/bad.toml"),
            "{line}: no file in: {err}"
        );
        assert!(err.contains(key), "{line}: no {key} in: {err}");
    }
    // The JSD alpha of the brief's base recipe (no [loss.hint] section: JSD is the default).
    let err = chain(&with_key("loss.hint", "divergence = \"jsd\"\nalpha = 1.0"));
    assert!(err.contains("[loss.hint] alpha"), "{err}");
    // A lower clip bound above the upper names both.
    let err = chain(&with_key(
        "loss",
        "sampler_importance_sampling_clip_min = 5.0\nsampler_importance_sampling_clip_max = 1.0",
    ));
    assert!(
        err.contains("[loss] sampler_importance_sampling_clip_min")
            && err.contains("sampler_importance_sampling_clip_max"),
        "{err}"
    );
    let err = chain(&with_key("loss", "reward_weights = [1.0, 2.0]"));
    assert!(
        err.contains("[loss] reward_weights") && err.contains("[[data.verifiers]]"),
        "{err}"
    );
    let err = chain(&with_key("loss", "loss_type = \"vespo\""));
    assert!(
        err.contains("recipes/bad.toml") && err.contains("sampler_importance_sampling_mode"),
        "{err}"
    );
}

/// Model, data, env and replay values that were silently accepted (a task of one problem, a
/// quadratic problem set, an ignored eval file, a channel switched on with nothing to replay).
#[test]
fn silently_accepted_nonsense_is_refused_naming_the_key() {
    for (section, line, key) in [
        (
            "model.builtin_tiny",
            "rms_norm_eps = nan",
            "[model.builtin_tiny] rms_norm_eps",
        ),
        (
            "model.builtin_tiny",
            "init_std = nan",
            "[model.builtin_tiny] init_std",
        ),
        (
            "model.builtin_tiny",
            "init_std = -1.0",
            "[model.builtin_tiny] init_std",
        ),
        (
            "data",
            "verifiers = [{ kind = \"numeric\", weight = nan }]",
            "[[data.verifiers]] #0 weight",
        ),
        (
            "data",
            "eval_dataset = \"/nonexistent/eval.jsonl\"",
            "[data] eval_dataset",
        ),
        (
            "data.arithmetic",
            "operand_max = 5",
            "[data.arithmetic] operand_max",
        ),
        (
            "data.arithmetic",
            "operand_max = 0",
            "[data.arithmetic] operand_max",
        ),
        (
            "data.arithmetic",
            "operand_max = 10",
            "[data.arithmetic] operand_max",
        ),
        (
            "data.arithmetic",
            "operand_max = 1000000000000",
            "[data.arithmetic] digits",
        ),
        ("data.arithmetic", "ops = []", "[data.arithmetic] ops"),
        ("replay", "traces = []", "[replay] traces"),
        ("loss", "hint_weight = -1.0", "[loss] hint_weight"),
        ("loss", "replay_weight = nan", "[loss] replay_weight"),
    ] {
        let err = chain(&with_key(section, line));
        assert!(
            err.contains("recipes/bad.toml"),
            "{line}: no file in: {err}"
        );
        assert!(err.contains(key), "{line}: no {key} in: {err}");
    }
    // Both keys of the empty replay channel.
    let err = chain(&with_key("replay", "traces = []"));
    assert!(err.contains("[loss] replay_weight"), "{err}");
    // digits = 4 with the default operand_max: 81 million problems, refused naming both keys.
    let four = with_key("data.arithmetic", "digits = 4").replace("operand_max = 49", "");
    let err = chain(&four);
    assert!(
        err.contains("[data.arithmetic] digits") && err.contains("operand_max"),
        "{err}"
    );
    // Generous sets still parse: 3 digits, all three operators; 4 digits, bounded operands.
    let three = with_key("data.arithmetic", "digits = 3")
        .replace("operand_max = 49", "")
        .replace("ops = [\"+\"]", "ops = [\"+\", \"-\", \"*\"]");
    parse_recipe(&three, Path::new("three.toml")).unwrap();
    let bounded =
        with_key("data.arithmetic", "digits = 4").replace("operand_max = 49", "operand_max = 1999");
    parse_recipe(&bounded, Path::new("bounded.toml")).unwrap();

    let env = |pass: &str| {
        format!(
            "{EMBEDDED_DEFAULT_RECIPE}\n[env]\nkind = \"builtin\"\nname = \"echo\"\npass_reward = {pass}\n"
        )
    };
    parse_recipe(&env("1.0"), Path::new("env.toml")).unwrap();
    let err = chain(&env("nan"));
    assert!(err.contains("[env] pass_reward"), "{err}");
}

/// A DiLoCo replica syncs every `inner_steps`: fewer `[train] steps` ran no round (exit 0), a
/// remainder trains steps no round averages.
#[test]
fn diloco_steps_must_be_a_multiple_of_inner_steps() {
    let diloco = |steps: usize, inner: usize| {
        format!(
            "{}\n[diloco]\ninner_steps = {inner}\nnum_replicas = 1\n",
            with_key("train", &format!("steps = {steps}"))
        )
    };
    for (steps, inner) in [(2, 3), (25, 10)] {
        let err = chain(&diloco(steps, inner));
        assert!(
            err.contains("recipes/bad.toml")
                && err.contains("[train] steps")
                && err.contains("[diloco] inner_steps"),
            "{err}"
        );
    }
    parse_recipe(&diloco(20, 10), Path::new("ok.toml")).unwrap();
}

/// Every shipped recipe (recipes/*.toml) still parses.
#[test]
fn shipped_recipes_parse() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../recipes");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            if let Err(e) = parse_recipe(&text, &path) {
                panic!("{}: {e:#}", path.display());
            }
            n += 1;
        }
    }
    assert!(n >= 4, "{n} recipes in {}", dir.display());
}
