//! Parity with the upstream implementations themselves: every case of
//! `tests/fixtures/upstream/*.json` was produced by `tools/ref_upstream.py`, which calls the
//! released TRL 1.16.0, verl 0.9.1 and pinned PRIME-RL code (the header of each file names the
//! versions, commit and sha256), including TRL's DPO (`DPOTrainer._compute_loss`) for the replay
//! channel's DPO term and TRL's SDPO (`SDPOTrainer.compute_loss`) for the hint channel and the
//! replay channel's teacher KL. composer-loss runs each case in f64; loss and gradient must agree
//! to 1e-6 relative (absolute floor 1e-9). The test prints the failure count of every family and
//! fails if any family has one.
mod common;
use candle_core::{DType, Device, Tensor, Var};
use common::*;
use composer_loss::*;
use serde_json::Value;
use std::collections::BTreeMap;

const DT: DType = DType::F64;
type R = std::result::Result<(), String>;

fn near(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-6 * want.abs() + 1e-9 || (got.is_nan() && want.is_nan())
}

fn cmp_all(what: &str, got: &[f64], want: &[f64]) -> R {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()));
    }
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        if !near(*g, *w) {
            return Err(format!("{what}[{k}]: got {g}, want {w}"));
        }
    }
    Ok(())
}

fn flat2(v: &Value) -> Vec<f64> {
    rows(v).concat()
}

fn tensor_flat(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

fn scale_of(case: &Value) -> LossScale {
    let s = &case["scale"];
    LossScale {
        global_active_tokens: s["global_active_tokens"].as_f64().unwrap(),
        global_sequences: s["global_sequences"].as_f64().unwrap(),
        num_micro_batches: s["num_micro_batches"].as_f64().unwrap(),
    }
}

fn run_rlvr(case: &Value) -> R {
    let cfg: RlvrConfig =
        serde_json::from_value(case["config"].clone()).map_err(|e| e.to_string())?;
    let inp = &case["inputs"];
    let lp = var2(&inp["trainer_logprobs"], DT);
    let adv = &inp["advantages"];
    let adv_t = if adv[0].is_array() {
        t2(adv, DT)
    } else {
        t1(adv, DT)
    };
    let mut x = LossInputs::new(lp.as_tensor().clone(), adv_t, t2(&inp["loss_mask"], DT));
    let opt2 = |k: &str| inp.get(k).filter(|v| !v.is_null()).map(|v| t2(v, DT));
    x.old_logprobs = opt2("old_logprobs");
    x.sampler_logprobs = opt2("sampler_logprobs");
    x.ref_logprobs = opt2("ref_logprobs");
    x.entropies = opt2("entropies");
    x.truncated = inp["truncated"]
        .as_array()
        .map(|a| a.iter().map(|b| b.as_bool().unwrap()).collect());
    let (loss, _) = rlvr_loss(&x, &cfg, &scale_of(case)).map_err(|e| e.to_string())?;
    let want = case["expected"]["loss"].as_f64().unwrap();
    let got = loss.to_scalar::<f64>().map_err(|e| e.to_string())?;
    if !near(got, want) {
        return Err(format!("loss: got {got}, want {want}"));
    }
    let grads = loss.backward().map_err(|e| e.to_string())?;
    let n = lp.as_tensor().elem_count();
    let g = grads
        .get(lp.as_tensor())
        .map(tensor_flat)
        .unwrap_or_else(|| vec![0.0; n]);
    cmp_all(
        "grad",
        &g,
        &flat2(&case["expected"]["grad_trainer_logprobs"]),
    )
}

fn run_agg(case: &Value) -> R {
    let mode: LossAggMode = serde_json::from_value(case["config"]["loss_agg_mode"].clone())
        .map_err(|e| e.to_string())?;
    let lsf = case["config"]["loss_scale_factor"].as_f64();
    let x = var2(&case["inputs"]["per_token"], DT);
    let m = t2(&case["inputs"]["loss_mask"], DT);
    let loss =
        agg_loss(x.as_tensor(), &m, mode, &scale_of(case), lsf).map_err(|e| e.to_string())?;
    let got = loss.to_scalar::<f64>().unwrap();
    let want = case["expected"]["loss"].as_f64().unwrap();
    if !near(got, want) {
        return Err(format!("loss: got {got}, want {want}"));
    }
    let grads = loss.backward().unwrap();
    let g = grads
        .get(x.as_tensor())
        .map(tensor_flat)
        .unwrap_or_default();
    cmp_all("grad", &g, &flat2(&case["expected"]["grad_per_token"]))
}

fn run_trl_adv(case: &Value) -> R {
    let cfg: AdvantageConfig =
        serde_json::from_value(case["config"].clone()).map_err(|e| e.to_string())?;
    let inp = &case["inputs"];
    let rpf = rows(&inp["rewards_per_func"]);
    let lengths: Vec<usize> = serde_json::from_value(inp["lengths"].clone()).unwrap();
    let n = inp["group_size"].as_u64().unwrap() as usize;
    let a = compute_advantages(&cfg, &rpf, &lengths, n).map_err(|e| e.to_string())?;
    cmp_all("advantages", &a, &f64s(&case["expected"]["advantages"]))
}

fn run_verl_adv(case: &Value) -> R {
    let inp = &case["inputs"];
    let rewards = f64s(&inp["rewards"]);
    let lengths: Vec<usize> = serde_json::from_value(inp["lengths"].clone()).unwrap();
    let n = inp["group_size"].as_u64().unwrap() as usize;
    let norm = case["config"]["norm_adv_by_std_in_grpo"].as_bool().unwrap();
    let est = case["config"]["estimator"].as_str().unwrap();
    let verl_grpo = AdvantageConfig {
        scale_rewards: if norm {
            StdScaling::Group
        } else {
            StdScaling::None
        },
        ..AdvantageConfig::verl()
    };
    let a = match est {
        "grpo" => compute_advantages(
            &verl_grpo,
            &rewards.iter().map(|r| vec![*r]).collect::<Vec<_>>(),
            &lengths,
            n,
        ),
        "rloo" => rloo_advantages(&rewards, n),
        "opo" => opo_advantages(&rewards, &lengths, n),
        "reinforce_plus_plus" => reinforce_plus_plus_advantages(&rewards, &lengths),
        "reinforce_plus_plus_baseline" => {
            reinforce_plus_plus_baseline_advantages(&rewards, &lengths, n)
        }
        "grpo_passk" => grpo_passk_advantages(&rewards, n, norm, verl_grpo.std_epsilon),
        "remax" => remax_advantages(&rewards, &f64s(&inp["reward_baselines"])),
        other => return Err(format!("estimator {other} not expressible")),
    }
    .map_err(|e| e.to_string())?;
    let want = rows(&case["expected"]["token_advantages"]);
    let got: Vec<f64> = want
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            let (ai, li) = (a[i], lengths[i]);
            (0..r.len()).map(move |j| if j < li { ai } else { 0.0 })
        })
        .collect();
    cmp_all("token_advantages", &got, &want.concat())
}

/// `[B, T, V]` logits → log-softmax with gradient (basic ops only, so backward exists).
fn log_softmax(x: &Tensor) -> Tensor {
    let max = x.max_keepdim(2).unwrap().detach();
    let lse = (x.broadcast_sub(&max).unwrap().exp().unwrap())
        .sum_keepdim(2)
        .unwrap()
        .log()
        .unwrap()
        .broadcast_add(&max)
        .unwrap();
    x.broadcast_sub(&lse).unwrap()
}

/// Integer ids `[B, T]` or `[B, T, K]` from the fixture as a u32 tensor.
fn ids(v: &Value) -> Tensor {
    let t = t3_or_2(v);
    t.to_dtype(DType::U32).unwrap()
}

fn t3_or_2(v: &Value) -> Tensor {
    if v[0][0].is_array() {
        t3(v, DT)
    } else {
        t2(v, DT)
    }
}

/// `lp` `[B, T, V]` gathered at `[B, T]` ids → `[B, T]`.
fn gather_tokens(lp: &Tensor, tok: &Tensor) -> Tensor {
    lp.gather(&tok.unsqueeze(2).unwrap(), 2)
        .unwrap()
        .squeeze(2)
        .unwrap()
}

/// Compare the loss and d loss / d `x` of a case whose gradient is `expected[grad_key]`.
fn check_loss_grad(case: &Value, loss: &Tensor, x: &Var, grad_key: &str) -> R {
    let want = case["expected"]["loss"].as_f64().unwrap();
    let got = loss.to_scalar::<f64>().map_err(|e| e.to_string())?;
    if !near(got, want) {
        return Err(format!("loss: got {got}, want {want}"));
    }
    let grads = loss.backward().map_err(|e| e.to_string())?;
    let g = grads
        .get(x.as_tensor())
        .map(tensor_flat)
        .unwrap_or_else(|| vec![0.0; x.as_tensor().elem_count()]);
    cmp_all("grad", &g, &flatten_value(&case["expected"][grad_key]))
}

/// TRL `DPOTrainer._compute_loss` on `[chosen; rejected]` per-token log-probs.
fn run_dpo(case: &Value) -> R {
    let cfg: DpoConfig =
        serde_json::from_value(case["config"].clone()).map_err(|e| e.to_string())?;
    let inp = &case["inputs"];
    let lp = var2(&inp["per_token_logprobs"], DT);
    let mask = t2(&inp["loss_mask"], DT);
    let p = lp.as_tensor().dim(0).unwrap() / 2;
    let seq = sequence_logprobs(lp.as_tensor(), &mask).map_err(|e| e.to_string())?;
    let lengths: Vec<usize> = rows(&inp["loss_mask"])
        .iter()
        .map(|r| r.iter().sum::<f64>() as usize)
        .collect();
    let x = DpoInputs {
        policy_chosen_logps: seq.narrow(0, 0, p).unwrap(),
        policy_rejected_logps: seq.narrow(0, p, p).unwrap(),
        ref_chosen_logps: t1(&inp["ref_chosen_logps"], DT),
        ref_rejected_logps: t1(&inp["ref_rejected_logps"], DT),
        chosen_lengths: lengths[..p].to_vec(),
        rejected_lengths: lengths[p..].to_vec(),
    };
    let (loss, m) = dpo_loss(&x, &cfg).map_err(|e| e.to_string())?;
    let want = &case["expected"]["metrics"];
    for (key, got) in [
        ("rewards/chosen", m.chosen_reward),
        ("rewards/rejected", m.rejected_reward),
        ("rewards/accuracies", m.reward_accuracy),
        ("rewards/margins", m.reward_margin),
    ] {
        let w = want[key].as_f64().unwrap();
        if !near(got, w) {
            return Err(format!("metric {key}: got {got}, want {w}"));
        }
    }
    check_loss_grad(case, &loss, &lp, "grad_per_token_logprobs")
}

/// TRL SDPO `compute_loss` (hint channel) through `composer_loss` with `hint_coef = 1/accum`,
/// as the trainer calls it; student log-probs built from the fixture's logits, so the gradient
/// is d loss / d student logits.
fn run_hint(case: &Value) -> R {
    let cfg: HintConfig =
        serde_json::from_value(case["config"].clone()).map_err(|e| e.to_string())?;
    let inp = &case["inputs"];
    let logits = var3(&inp["student_logits"], DT);
    let s_lp = log_softmax(logits.as_tensor());
    let t_lp = log_softmax(&t3(&inp["teacher_logits"], DT));
    let tok = ids(&inp["completion_ids"]);
    let mask = t2(&inp["loss_mask"], DT);
    let b = mask.dim(0).unwrap();
    let mut x = LossInputs::new(
        gather_tokens(&s_lp, &tok),
        Tensor::zeros(b, DT, &Device::Cpu).unwrap(),
        mask,
    );
    x.old_logprobs = inp
        .get("old_logprobs")
        .filter(|v| !v.is_null())
        .map(|v| t2(v, DT));
    let has_hint: Vec<bool> = serde_json::from_value(inp["has_hint"].clone()).unwrap();
    let (student, teacher, topk_ids) = match inp.get("student_topk_ids").filter(|v| !v.is_null()) {
        Some(v) => {
            let k = ids(v);
            (
                s_lp.gather(&k, 2).unwrap(),
                t_lp.gather(&k, 2).unwrap(),
                Some(k),
            )
        }
        None => (s_lp.clone(), t_lp.clone(), None),
    };
    x.hint = Some(HintInputs {
        student_topk_logprobs: Some(student),
        teacher_topk_logprobs: Some(teacher),
        topk_ids,
        teacher_token_logprobs: Some(gather_tokens(&t_lp, &tok)),
        has_hint,
    });
    let accum = case["accumulation_steps"].as_f64().unwrap();
    let ccfg = ComposerConfig {
        use_rlvr: false,
        use_hint: true,
        hint_coef: 1.0 / accum,
        hint: cfg,
        ..Default::default()
    };
    let scale = LossScale {
        global_active_tokens: 1.0,
        global_sequences: b as f64,
        num_micro_batches: accum,
    };
    let (loss, _) = composer_loss(&x, &ccfg, &scale).map_err(|e| e.to_string())?;
    check_loss_grad(case, &loss, &logits, "grad_student_logits")
}

/// TRL SDPO's teacher-server path (teacher's recorded top-K, forward KL) as the replay
/// channel's teacher KL, through `replay_loss` with `kl_coef = 1/accum`.
fn run_teacher_kl(case: &Value) -> R {
    let inp = &case["inputs"];
    let logits = var3(&inp["student_logits"], DT);
    let s_lp = log_softmax(logits.as_tensor());
    let k_ids = ids(&inp["teacher_topk_ids"]);
    let mask = t2(&inp["loss_mask"], DT);
    let b = mask.dim(0).unwrap();
    let cfg = ReplayConfig {
        support: serde_json::from_value(case["config"]["support"].clone()).unwrap(),
        kl_loss_agg_mode: serde_json::from_value(case["config"]["kl_loss_agg_mode"].clone())
            .unwrap(),
        kl_coef: 1.0 / case["accumulation_steps"].as_f64().unwrap(),
        ..Default::default()
    };
    let x = ReplayInputs {
        dpo: None,
        teacher_kl: Some(TeacherKlInputs {
            student_topk_logprobs: s_lp.gather(&k_ids, 2).unwrap(),
            teacher_topk_logprobs: t3(&inp["teacher_topk_logprobs"], DT),
            loss_mask: mask,
            teachers: vec!["teacher".into(); b],
        }),
    };
    let (loss, _) = replay_loss(&x, &cfg).map_err(|e| e.to_string())?;
    check_loss_grad(case, &loss, &logits, "grad_student_logits")
}

#[test]
fn upstream_parity_per_family() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/upstream");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 8, "fixtures missing in {dir}");
    let mut stats: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut first: BTreeMap<String, String> = BTreeMap::new();
    for f in &files {
        let fx: Value = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
        assert!(
            fx["header"]["packages"].is_object(),
            "{f:?}: header names no versions"
        );
        for case in fx["cases"].as_array().unwrap() {
            let fam = case["family"].as_str().unwrap().to_string();
            let r = match case["kind"].as_str().unwrap() {
                "rlvr" => run_rlvr(case),
                "agg" => run_agg(case),
                "advantages" => run_trl_adv(case),
                "verl_advantages" => run_verl_adv(case),
                "dpo" => run_dpo(case),
                "hint" => run_hint(case),
                "teacher_kl" => run_teacher_kl(case),
                k => Err(format!("unknown kind {k}")),
            };
            let e = stats.entry(fam.clone()).or_default();
            e.0 += 1;
            if let Err(msg) = r {
                e.1 += 1;
                first
                    .entry(fam)
                    .or_insert_with(|| format!("{}: {msg}", case["name"].as_str().unwrap()));
            }
        }
    }
    let _ = (Device::Cpu, Var::from_tensor);
    let mut total = 0;
    println!("{:<40} {:>6} {:>8}", "family", "cases", "failures");
    for (fam, (n, bad)) in &stats {
        println!("{fam:<40} {n:>6} {bad:>8}");
        total += bad;
    }
    for (fam, msg) in &first {
        println!("first failure in {fam}: {msg}");
    }
    assert_eq!(total, 0, "{total} upstream parity failures (table above)");
}
