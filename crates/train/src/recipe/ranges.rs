//! Range checks of a parsed recipe, run by [`crate::recipe::parse_recipe`] before anything is
//! built: a bad value must stop the run at parse time, not after the model has loaded (or, worse,
//! train silently on NaNs or a zero advantage). Each error names the file, the key and the
//! allowed range, so it can be fixed without reading the code.

use std::path::Path;

use anyhow::{bail, Result};
use composer_loss::advantages::AdvantageEstimator;

use super::sections::Recipe;

/// Most samples a step (prompts × generations) and most examples a warm-up batch: a typo
/// (1e9) must be refused before anything is allocated.
const MAX_BATCH: usize = 1 << 20;
/// Most tokens a KV block holds (a block is allocated whole).
const MAX_KV_BLOCK: usize = 1 << 16;
/// Most problems the arithmetic task generates (every operand pair of every operator is built
/// up front: `digits = 4` with the default `operand_max` is 81 million pairs, gigabytes).
pub(super) const MAX_ARITHMETIC_PROBLEMS: u64 = 1 << 22;

/// Checks every numeric range and cross-key rule of `r` that the serde types cannot express;
/// `origin` is the recipe file named in the error.
pub fn validate_ranges(r: &Recipe, origin: &Path) -> Result<()> {
    let file = origin.display();
    // One error shape for every key: file, key, offending value, allowed range.
    let out_of_range = |key: &str, value: String, allowed: &str| -> Result<()> {
        bail!("recipe {file}: key `{key}` = {value} is out of range; allowed: {allowed}")
    };

    validate_lora(r, origin)?;
    validate_model_and_data(r, origin)?;

    let o = &r.optimizer;
    if !(o.lr >= 0.0) || !o.lr.is_finite() {
        out_of_range("[optimizer] lr", o.lr.to_string(), "a finite number >= 0")?;
    }
    if !(o.weight_decay >= 0.0) || !o.weight_decay.is_finite() {
        out_of_range(
            "[optimizer] weight_decay",
            o.weight_decay.to_string(),
            "a finite number >= 0",
        )?;
    }
    for (i, beta) in o.betas.iter().enumerate() {
        // β = 1 never forgets (the bias correction divides by 1 − β^t = 0); β < 0 oscillates.
        if !(0.0..1.0).contains(beta) {
            out_of_range(
                "[optimizer] betas",
                format!("{:?} (beta{} = {beta})", o.betas, i + 1),
                "each beta in [0, 1)",
            )?;
        }
    }
    if !(o.eps > 0.0 && o.eps.is_finite()) {
        // 0 divides by √v̂ = 0 on a zero gradient: NaN weights, written to the checkpoint.
        out_of_range("[optimizer] eps", o.eps.to_string(), "a finite number > 0")?;
    }
    if !(o.max_grad_norm >= 0.0 && o.max_grad_norm.is_finite()) {
        out_of_range(
            "[optimizer] max_grad_norm",
            o.max_grad_norm.to_string(),
            "a finite number >= 0 (0 = no clipping)",
        )?;
    }
    if let Some(w) = &r.warmup {
        if !(w.lr >= 0.0) || !w.lr.is_finite() {
            out_of_range("[warmup] lr", w.lr.to_string(), "a finite number >= 0")?;
        }
        if !(1..=MAX_BATCH).contains(&w.batch_size) {
            out_of_range(
                "[warmup] batch_size",
                w.batch_size.to_string(),
                &format!("1..={MAX_BATCH}"),
            )?;
        }
        if !(0.0..=1.0).contains(&w.hint_fraction) {
            out_of_range(
                "[warmup] hint_fraction",
                w.hint_fraction.to_string(),
                "[0, 1] (the share of warm-up examples shown in the hint format)",
            )?;
        }
    }
    let samples = r
        .train
        .prompts_per_step
        .saturating_mul(r.rollout.num_generations);
    if samples > MAX_BATCH {
        out_of_range(
            "[train] prompts_per_step × [rollout] num_generations",
            format!(
                "{} × {} = {samples}",
                r.train.prompts_per_step, r.rollout.num_generations
            ),
            &format!("at most {MAX_BATCH} samples a step"),
        )?;
    }
    if r.rollout.kv_block_size > MAX_KV_BLOCK {
        out_of_range(
            "[rollout] kv_block_size",
            r.rollout.kv_block_size.to_string(),
            &format!("1..={MAX_KV_BLOCK} tokens a block"),
        )?;
    }
    for (key, w) in [
        ("[loss] hint_weight", r.loss.hint_weight),
        ("[loss] replay_weight", r.loss.replay_weight),
    ] {
        if !(w >= 0.0 && w.is_finite()) {
            out_of_range(key, w.to_string(), "a finite number >= 0 (0 = channel off)")?;
        }
    }
    super::loss_ranges::validate_loss(r, origin)?;
    if let Some(rp) = &r.replay {
        if rp.traces.is_empty() && r.loss.replay_weight > 0.0 {
            bail!(
                "recipe {file}: key `[loss] replay_weight` = {} switches the replay channel on, \
                 but `[replay] traces` = [] gives it nothing to replay; allowed: at least one \
                 trace source (e.g. traces = [\"builtin:scripted\"]), or replay_weight = 0",
                r.loss.replay_weight
            );
        }
        if let Some(w) = rp
            .teacher_weights
            .iter()
            .find(|w| !(**w >= 0.0 && w.is_finite()))
        {
            out_of_range(
                "[replay] teacher_weights",
                w.to_string(),
                "finite numbers >= 0",
            )?;
        }
    }
    let t = &r.train;
    if !(0.0..=1.0).contains(&t.stop_at_accuracy) {
        out_of_range(
            "[train] stop_at_accuracy",
            t.stop_at_accuracy.to_string(),
            "[0, 1] (0 = never stop early)",
        )?;
    }
    if t.max_nonfinite_steps == 0 {
        out_of_range(
            "[train] max_nonfinite_steps",
            "0".into(),
            "an integer >= 1 (consecutive skipped steps before the run stops)",
        )?;
    }
    for (i, v) in r.data.verifiers.iter().enumerate() {
        if !v.weight.is_finite() {
            out_of_range(
                &format!("[[data.verifiers]] #{i} weight"),
                v.weight.to_string(),
                "a finite number (negative: a penalty)",
            )?;
        }
    }

    let ro = &r.rollout;
    if ro.max_completion_length == 0 {
        out_of_range(
            "[rollout] max_completion_length",
            "0".into(),
            "an integer >= 1 (tokens per completion)",
        )?;
    }
    if !(ro.top_p > 0.0 && ro.top_p <= 1.0) {
        out_of_range(
            "[rollout] top_p",
            ro.top_p.to_string(),
            "(0, 1] (1 = nucleus sampling off)",
        )?;
    }
    if !(0.0..=1.0).contains(&ro.min_p) {
        out_of_range(
            "[rollout] min_p",
            ro.min_p.to_string(),
            "[0, 1] (0 = min-p sampling off)",
        )?;
    }
    if !(ro.temperature >= 0.0) || !ro.temperature.is_finite() {
        out_of_range(
            "[rollout] temperature",
            ro.temperature.to_string(),
            "a finite number >= 0",
        )?;
    }
    // A group of one has no peers: its group-relative advantage is always 0 (rloo divides by
    // G − 1 = 0), so the RL channel would never learn.
    let group_relative = matches!(
        r.loss.advantage.estimator,
        AdvantageEstimator::Grpo
            | AdvantageEstimator::Rloo
            | AdvantageEstimator::ReinforcePlusPlusBaseline
            | AdvantageEstimator::Opo
            | AdvantageEstimator::GrpoPassk
    );
    if ro.num_generations == 1 && group_relative {
        bail!(
            "recipe {file}: key `[rollout] num_generations` = 1 is out of range for the \
             group-normalised advantage `[loss] estimator = {:?}`; allowed: num_generations >= 2 \
             (or `estimator = \"reinforce_plus_plus\"`, which normalises over the batch)",
            estimator_name(r.loss.advantage.estimator)
        );
    }

    let adv = &r.loss.advantage;
    if adv.estimator == AdvantageEstimator::GrpoPassk
        && adv.scale_rewards == composer_loss::StdScaling::Batch
    {
        bail!(
            "recipe {file}: key `[loss] scale_rewards` = \"batch\" is not supported with \
             `estimator = \"grpo_passk\"` (verl normalises Pass@k within the group); allowed: \
             \"group\" or \"none\""
        );
    }
    if adv.estimator == AdvantageEstimator::Remax {
        if r.env.is_some() {
            bail!(
                "recipe {file}: key `[loss] estimator` = \"remax\" is not supported with `[env]`: \
                 ReMax's baseline is the reward of a greedy completion of each prompt, and the \
                 env rollout does not play a greedy baseline episode; allowed with `[env]`: \
                 grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, opo, grpo_passk"
            );
        }
        if adv.multi_objective_aggregation
            != composer_loss::MultiRewardAggregation::SumThenNormalize
        {
            bail!(
                "recipe {file}: key `[loss] multi_objective_aggregation` = \"normalize_then_sum\" \
                 is not supported with `estimator = \"remax\"`; allowed: \"sum_then_normalize\""
            );
        }
    }

    // A budget below one completion could never hold a row of the batch.
    if let Some(budget) = r.train.max_tokens_per_microbatch {
        if budget < ro.max_completion_length {
            out_of_range(
                "[train] max_tokens_per_microbatch",
                budget.to_string(),
                &format!(
                    "an integer >= `[rollout] max_completion_length` ({}): a micro-batch must \
                     hold at least one completion",
                    ro.max_completion_length
                ),
            )?;
        }
    }

    // fp16's narrow exponent range underflows small gradients without loss scaling.
    if r.train.fp16 {
        bail!(
            "recipe {file}: key `[train] fp16` = true is not supported: fp16 training needs \
             dynamic loss scaling, which composer-rl does not implement; allowed: fp16 = false, \
             or `[train] bf16 = true` (bf16 compute with f32 master weights, no loss scaling)"
        );
    }

    let d = &r.data;
    // With `[env]` the env's reward replaces the verifiers, so an empty list is fine there.
    if d.verifiers.is_empty() && r.env.is_none() {
        out_of_range(
            "[data] verifiers",
            "[]".into(),
            "at least one verifier (e.g. verifiers = [{ kind = \"numeric\" }]); without one every reward is 0",
        )?;
    }
    if d.task.is_some() && d.dataset.is_some() {
        bail!(
            "recipe {file}: keys `[data] task` and `[data] dataset` are both set; allowed: exactly \
             one of them (the built-in task or a JSONL dataset)"
        );
    }
    if d.eval_size == 0 {
        out_of_range(
            "[data] eval_size",
            "0".into(),
            "an integer >= 1 (held-out eval rows)",
        )?;
    }
    Ok(())
}

/// The recipe spelling of an estimator (serde's snake_case name).
fn estimator_name(e: AdvantageEstimator) -> String {
    serde_json::to_value(e)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{e:?}"))
}

/// `[model] use_peft` and the `lora_*` keys (TRL's `ModelConfig`), checked before any model
/// loads: the values (each error names its key), the model they apply to (an HF directory of a
/// family composer-model adapts; not a PEFT adapter directory), and TRL's refusal of
/// `sync_ref_model` with PEFT.
fn validate_lora(r: &Recipe, origin: &Path) -> Result<()> {
    let file = origin.display();
    if let Some(p) = &r.model.path {
        // Also without use_peft: such a directory holds no model weights to load.
        if p.join(composer_model::lora::ADAPTER_CONFIG_FILE).is_file() {
            bail!(
                "recipe {file}: key `[model] path` = {}: a PEFT adapter directory ({}), not a \
                 model; set `path` to its base model (the adapter's `base_model_name_or_path`), \
                 or write full weights with `composer-rl export {} --out DIR --merge` and train \
                 those",
                p.display(),
                composer_model::lora::ADAPTER_CONFIG_FILE,
                p.display()
            );
        }
    }
    let lora = r
        .model
        .lora_config()
        .map_err(|e| anyhow::anyhow!("recipe {file}: [model] {e:#}"))?;
    if lora.is_none() {
        return Ok(());
    }
    if let Some(p) = &r.model.path {
        composer_model::ModelConfig::from_dir(p).map_err(|e| {
            anyhow::anyhow!(
                "recipe {file}: key `[model] use_peft` = true: LoRA cannot be applied to `[model] \
                 path` = {}: {e:#}",
                p.display()
            )
        })?;
    }
    if r.loss.reference.sync_ref_model {
        bail!(
            "recipe {file}: key `[loss] sync_ref_model` = true is not supported with `[model] \
             use_peft` = true (as TRL's GRPOTrainer: a LoRA run's reference is the policy at the \
             start of RL, or `ref_model_path`); set one of them to false"
        );
    }
    Ok(())
}

/// `[model.builtin_tiny]`'s floats, `[data]`'s task options and `[env] pass_reward`.
fn validate_model_and_data(r: &Recipe, origin: &Path) -> Result<()> {
    let file = origin.display();
    if let Some(t) = &r.model.builtin_tiny {
        for (key, x) in [
            ("rms_norm_eps", t.rms_norm_eps),
            ("init_std", t.init_std),
            ("rope_theta", t.rope_theta),
        ] {
            if !(x > 0.0 && x.is_finite()) {
                bail!(
                    "recipe {file}: key `[model.builtin_tiny] {key}` = {x} is out of range; \
                     allowed: a finite number > 0"
                );
            }
        }
    }
    let d = &r.data;
    if d.task.is_some() {
        if let Some(e) = &d.eval_dataset {
            bail!(
                "recipe {file}: key `[data] eval_dataset` = {:?} is set with `[data] task`, \
                 whose eval rows are generated (it would be ignored); allowed: eval_dataset \
                 with `[data] dataset` only (drop it, or set `eval_size`)",
                e.display()
            );
        }
        validate_arithmetic(&d.arithmetic, origin)?;
    }
    if let Some(env) = &r.env {
        if !env.pass_reward.is_finite() {
            bail!(
                "recipe {file}: key `[env] pass_reward` = {} is out of range; allowed: a finite \
                 number (rewards at or above it count as passed)",
                env.pass_reward
            );
        }
    }
    Ok(())
}

/// `[data.arithmetic]`: `operand_max` at least one above the smallest `digits`-digit operand
/// (below it the task collapses to one problem), and at most [`MAX_ARITHMETIC_PROBLEMS`]
/// problems built. `digits` and `ops` themselves are checked by `rules`.
fn validate_arithmetic(a: &super::ArithmeticConfig, origin: &Path) -> Result<()> {
    let file = origin.display();
    if !(1..=4).contains(&a.digits) {
        return Ok(()); // refused by `rules`, naming `[data.arithmetic] digits`
    }
    // As `task::arithmetic_split`: operands lo..=max.
    let lo = if a.digits == 1 {
        0
    } else {
        10u64.pow(a.digits - 1)
    };
    let max = match a.operand_max {
        Some(m) if m <= lo => bail!(
            "recipe {file}: key `[data.arithmetic] operand_max` = {m} is out of range for \
             `digits` = {}: the operands start at {lo}, so every problem would be \
             {lo}{op}{lo}; allowed: operand_max >= {}",
            a.digits,
            lo + 1,
            op = a.ops.first().map_or("+", String::as_str),
        ),
        Some(m) => m,
        None => 10u64.pow(a.digits) - 1,
    };
    if a.ops.is_empty() {
        bail!(
            "recipe {file}: key `[data.arithmetic] ops` = [] builds no problems; allowed: one or \
             more of \"+\", \"-\", \"*\""
        );
    }
    let span = max - lo + 1;
    let problems = span.saturating_mul(span).saturating_mul(a.ops.len() as u64);
    if problems > MAX_ARITHMETIC_PROBLEMS {
        bail!(
            "recipe {file}: keys `[data.arithmetic] digits` = {} / `operand_max` = {max} \
             (with {} op(s)) build {problems} problems (every operand pair is generated up \
             front); allowed: at most {MAX_ARITHMETIC_PROBLEMS}: lower `digits`, or set \
             `operand_max` to at most {}",
            a.digits,
            a.ops.len(),
            lo + max_span(a.ops.len() as u64) - 1
        );
    }
    Ok(())
}

/// Most operands per side that keep `ops` operators within [`MAX_ARITHMETIC_PROBLEMS`].
fn max_span(ops: u64) -> u64 {
    ((MAX_ARITHMETIC_PROBLEMS / ops.max(1)) as f64)
        .sqrt()
        .floor() as u64
}
