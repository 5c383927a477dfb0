//! `plan --from-run` on metrics no run can write: refused naming the file, line and key,
//! instead of a plan with a −500% wall share or walls of 10³⁰⁰ hours.

use composer_plan::plan_from_run;

fn plan_error(lines: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("metrics.jsonl"), lines).unwrap();
    match plan_from_run(dir.path()) {
        Ok(plan) => panic!("planned from bad metrics:\n{plan}"),
        Err(e) => format!("{e:#}"),
    }
}

const GOOD: &str =
    "{\"kind\":\"train\",\"step\":1,\"time/rollout_s\":6,\"time/train_s\":2,\"time/step_s\":8}\n";

#[test]
fn negative_wall_is_refused_with_file_line_and_key() {
    let e = plan_error(&format!(
        "{GOOD}{{\"kind\":\"train\",\"step\":2,\"time/rollout_s\":6,\"time/train_s\":-50,\"time/step_s\":10}}\n"
    ));
    assert!(
        e.contains("metrics.jsonl line 2") && e.contains("time/train_s = -50"),
        "{e}"
    );
}

#[test]
fn astronomically_long_wall_is_refused() {
    let e = plan_error(&format!(
        "{GOOD}{{\"kind\":\"train\",\"step\":2,\"time/rollout_s\":1e308,\"time/train_s\":2}}\n"
    ));
    assert!(
        e.contains("metrics.jsonl line 2") && e.contains("time/rollout_s = 1e308"),
        "{e}"
    );
}

/// Flags far beyond any real workload are refused naming the flag: `--gpus 18446744073709551615`
/// used to loop over every generator/trainer split (a hang), and `--params 1e300` printed a plan
/// of 10²⁸⁴ T parameters with NaN shares.
#[test]
fn absurdly_large_flags_are_refused_naming_the_flag() {
    use composer_plan::{plan_cli, PlanOptions};
    let base = PlanOptions {
        params: Some(7e9),
        mean_output: Some(500.0),
        ..Default::default()
    };
    let cases: Vec<(&str, PlanOptions)> = vec![
        (
            "--gpus",
            PlanOptions {
                gpus: Some(usize::MAX),
                ..base.clone()
            },
        ),
        (
            "--params",
            PlanOptions {
                params: Some(1e300),
                ..base.clone()
            },
        ),
        (
            "--mean-output",
            PlanOptions {
                mean_output: Some(1e300),
                ..base.clone()
            },
        ),
        (
            "--p95-output",
            PlanOptions {
                p95_output: Some(1e300),
                ..base.clone()
            },
        ),
        (
            "--prompt-tokens",
            PlanOptions {
                prompt_tokens: Some(1e300),
                ..base.clone()
            },
        ),
        (
            "--samples-per-step",
            PlanOptions {
                samples_per_step: Some(usize::MAX),
                ..base.clone()
            },
        ),
        (
            "--env-latency",
            PlanOptions {
                env_latency: Some(1e300),
                ..base.clone()
            },
        ),
        (
            "--env-latency-p95",
            PlanOptions {
                env_latency_p95: Some(1e300),
                ..base.clone()
            },
        ),
        (
            "--env-calls",
            PlanOptions {
                env_calls: Some(1e300),
                ..base.clone()
            },
        ),
        (
            "--weight-copies",
            PlanOptions {
                weight_copies: Some(usize::MAX),
                ..base.clone()
            },
        ),
        (
            "--layers",
            PlanOptions {
                layers: Some(usize::MAX),
                ..base.clone()
            },
        ),
        (
            "--hidden",
            PlanOptions {
                hidden: Some(usize::MAX),
                ..base.clone()
            },
        ),
        (
            "--kv-heads",
            PlanOptions {
                kv_heads: Some(usize::MAX),
                ..base.clone()
            },
        ),
        (
            "--head-dim",
            PlanOptions {
                head_dim: Some(usize::MAX),
                ..base.clone()
            },
        ),
        (
            "--mfu",
            PlanOptions {
                mfu: Some(1e-300),
                ..base.clone()
            },
        ),
    ];
    for (flag, opts) in cases {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(plan_cli(&opts).map_err(|e| format!("{e:#}")));
        });
        let result = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("{flag}: plan did not finish within 30 s"));
        match result {
            Ok(plan) => panic!("{flag}: planned:\n{plan}"),
            Err(e) => assert!(e.contains(flag), "{flag}: {e}"),
        }
    }
}
