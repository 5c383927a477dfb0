//! Values that used to break a run later (a panic, NaN weights, a run of 0 rounds), every loss
//! option under its recipe key, and the shipped recipes.

use super::*;

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
