//! Cross-key rules of a parsed recipe.

use anyhow::{bail, Context, Result};

use super::sections::{Recipe, TrainMode};
use super::EnvSection;

pub(super) fn validate(r: &Recipe) -> Result<()> {
    match (&r.model.path, &r.model.builtin_tiny) {
        (None, None) => bail!("key `[model]`: set `path` (an HF checkpoint) or `builtin_tiny`"),
        (Some(_), Some(_)) => bail!("key `[model]`: set only one of `path` and `builtin_tiny`"),
        _ => {}
    }
    match (&r.data.task, &r.data.dataset) {
        (None, None) => {
            bail!("key `[data]`: set `task = \"arithmetic\"` or `dataset = \"file.jsonl\"`")
        }
        (Some(t), _) if t != "arithmetic" => {
            bail!("key `[data] task`: unknown task {t:?} (known: \"arithmetic\")")
        }
        _ => {}
    }
    if !(1..=4).contains(&r.data.arithmetic.digits) {
        bail!(
            "key `[data.arithmetic] digits`: must be 1..=4, got {}",
            r.data.arithmetic.digits
        );
    }
    for op in &r.data.arithmetic.ops {
        if !["+", "-", "*"].contains(&op.as_str()) {
            bail!("key `[data.arithmetic] ops`: unknown operator {op:?} (known: + - *)");
        }
    }
    for (i, v) in r.data.verifiers.iter().enumerate() {
        match v.kind.as_str() {
            "exact" | "numeric" | "code" => {}
            "regex" => {
                let p = v.pattern.as_deref().with_context(|| {
                    format!("key `[[data.verifiers]]` #{i}: kind = \"regex\" needs `pattern`")
                })?;
                regex::Regex::new(&p.replace("{answer}", "0"))
                    .with_context(|| format!("key `[[data.verifiers]]` #{i} pattern"))?;
            }
            k => bail!("key `[[data.verifiers]]` #{i} kind: unknown verifier {k:?} (known: exact, numeric, regex, code)"),
        }
    }
    let one_of = |key: &str, v: &str, allowed: &[&str]| -> Result<()> {
        if !allowed.contains(&v) {
            bail!(
                "key `{key}`: unknown value {v:?} (known: {})",
                allowed.join(", ")
            );
        }
        Ok(())
    };
    one_of(
        "[data] overlong_prompts",
        &r.data.overlong_prompts,
        &["error", "skip"],
    )?;
    one_of(
        "[optimizer] schedule",
        &r.optimizer.schedule,
        &["constant", "cosine"],
    )?;
    if !r.loss.hint.template.reprompt.contains("{prompt}") {
        bail!("key `[loss.hint.template] reprompt`: must contain {{prompt}}");
    }
    if r.loss.hint.top_k == 0 {
        bail!("key `[loss.hint] top_k`: must be >= 1");
    }
    if r.rollout.num_generations < 1 || r.train.prompts_per_step < 1 {
        bail!("key `[rollout] num_generations` and `[train] prompts_per_step` must be >= 1");
    }
    if r.rollout.temperature < 0.0 {
        bail!("key `[rollout] temperature`: must be >= 0");
    }
    if r.rollout.kv_block_size == 0 {
        bail!("key `[rollout] kv_block_size`: must be >= 1 (token slots per KV block)");
    }
    let budget = r.rollout.kv_token_budget;
    if budget > 0 && budget <= r.rollout.max_completion_length {
        bail!(
            "key `[rollout] kv_token_budget` = {budget} cannot hold one sample: it must exceed max_completion_length ({}) plus the prompt",
            r.rollout.max_completion_length
        );
    }
    if r.train.mode == TrainMode::Async && r.rollout.cuda_graphs && r.model.device.trim() != "cpu" {
        bail!(
            "key `[rollout] cuda_graphs = true` with `[train] mode = \"async\"` on device `{}`: a CUDA graph capture records all work on the device, the trainer's too; use `mode = \"sync\"` or `cuda_graphs = false`",
            r.model.device
        );
    }
    if r.train.mode == TrainMode::Async && r.env.is_some() {
        bail!("key `[train] mode = \"async\"` does not support `[env]` rollouts yet; use `mode = \"sync\"`");
    }
    if !(r.train.reward_latency_s >= 0.0) {
        bail!("key `[train] reward_latency_s` must be >= 0");
    }
    if r.train.num_iterations < 1
        || r.train.mini_batches < 1
        || r.train.gradient_accumulation_steps < 1
    {
        bail!("key `[train] num_iterations`, `mini_batches`, `gradient_accumulation_steps` must be >= 1");
    }
    if let Some(env) = &r.env {
        validate_env(env, r)?;
    }
    let rf = &r.loss.reference;
    if rf.sync_ref_model {
        if !(0.0..=1.0).contains(&rf.ref_model_mixup_alpha) {
            bail!(
                "key `[loss] ref_model_mixup_alpha`: must be in [0, 1], got {}",
                rf.ref_model_mixup_alpha
            );
        }
        if rf.ref_model_sync_steps < 1 {
            bail!("key `[loss] ref_model_sync_steps`: must be >= 1");
        }
    }
    if let Some(p) = &rf.ref_model_path {
        if !p.join("config.json").is_file() {
            bail!(
                "key `[loss] ref_model_path`: {} is not an HF checkpoint directory (no config.json)",
                p.display()
            );
        }
    }
    if let Some(rp) = &r.replay {
        if !rp.teacher_weights.is_empty() && rp.teacher_weights.len() != rp.traces.len() {
            bail!(
                "key `[replay] teacher_weights`: {} weights for {} trace files",
                rp.teacher_weights.len(),
                rp.traces.len()
            );
        }
    }
    Ok(())
}

pub(super) fn validate_env(e: &EnvSection, r: &Recipe) -> Result<()> {
    match e.kind.as_str() {
        "builtin" => match e.name.as_deref() {
            Some("code" | "echo") => {}
            Some(other) => {
                bail!("key `[env] name`: unknown built-in env {other:?} (known: code, echo)")
            }
            None => bail!("key `[env] name`: kind = \"builtin\" needs `name` (code or echo)"),
        },
        "openenv" | "openenv_tools" => {
            if e.url.is_none() && e.url_env.is_none() {
                bail!(
                    "key `[env] url`: kind = {:?} needs `url` (http://HOST:PORT) or `url_env`",
                    e.kind
                );
            }
        }
        other => bail!(
            "key `[env] kind`: unknown value {other:?} (known: builtin, openenv, openenv_tools)"
        ),
    }
    if e.kind == "openenv_tools" {
        // The chat template renders every observation; text templates would corrupt it.
        for (key, t) in [
            ("prompt_template", &e.prompt_template),
            ("observation_template", &e.observation_template),
        ] {
            if t != "{observation}" {
                bail!("key `[env] {key}`: kind = \"openenv_tools\" renders observations with the chat template; leave it at \"{{observation}}\"");
            }
        }
    } else {
        for key in ["chat_template", "system_prompt"] {
            let set = match key {
                "chat_template" => e.chat_template.is_some(),
                _ => e.system_prompt.is_some(),
            };
            if set {
                bail!("key `[env] {key}`: only used with kind = \"openenv_tools\"");
            }
        }
    }
    if e.max_turns < 1 {
        bail!("key `[env] max_turns`: must be >= 1");
    }
    if e.max_concurrent < 1 {
        bail!("key `[env] max_concurrent`: must be >= 1");
    }
    if e.max_total_tokens <= r.rollout.max_completion_length {
        bail!(
            "key `[env] max_total_tokens`: {} leaves no room for a prompt before `[rollout] max_completion_length` = {}",
            e.max_total_tokens,
            r.rollout.max_completion_length
        );
    }
    for (key, v) in [
        ("call_timeout_s", e.call_timeout_s),
        ("episode_timeout_s", e.episode_timeout_s),
        ("connect_timeout_s", e.connect_timeout_s),
        ("server_down_budget_s", e.server_down_budget_s),
    ] {
        if !(v > 0.0) || !v.is_finite() {
            bail!("key `[env] {key}`: must be a positive number of seconds, got {v}");
        }
    }
    // The pool's time budget (`episode_timeout - 2 * call_timeout`: room for the last step and
    // the grading) must be positive, or a slow episode hits the hard limit and fails instead
    // of being graded (composer-env's `PoolConfig::episode_timeout`).
    if e.episode_timeout_s <= 2.0 * e.call_timeout_s {
        bail!(
            "key `[env] episode_timeout_s` = {}: must exceed 2 x `[env] call_timeout_s` ({}): past \
             episode_timeout_s - 2 x call_timeout_s no turn starts and the episode is graded, with \
             room left for the last step and the grading",
            e.episode_timeout_s,
            e.call_timeout_s
        );
    }
    if !["final", "sum"].contains(&e.reward.as_str()) {
        bail!(
            "key `[env] reward`: unknown value {:?} (known: final, sum)",
            e.reward
        );
    }
    for (key, t) in [
        ("prompt_template", &e.prompt_template),
        ("observation_template", &e.observation_template),
    ] {
        if !t.contains("{observation}") {
            bail!("key `[env] {key}`: must contain {{observation}}");
        }
    }
    Ok(())
}
