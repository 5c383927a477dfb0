//! Issue 19, run safety: a fresh run refuses a directory holding a run (unless
//! `overwrite`), two processes never share a run directory, a recipe given with `--resume`
//! must be the run's own (and its data files unchanged), overlong prompts are reported by file and line, a corrupted
//! checkpoint is a clear error (never a panic), and a failed checkpoint write (disk full)
//! keeps the last good checkpoint.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use composer_train::checkpoint::{self, CheckpointData, TrainerState};
use composer_train::{run_train, RunOutcome, TrainOptions};

mod common;
use common::tiny_model_and_task;

/// One RL step on the tiny model, with a checkpoint.
const ONE_STEP: &str = concat!(
    tiny_model_and_task!(),
    r#"
[rollout]
num_generations = 2
max_completion_length = 3

[train]
steps = 1
prompts_per_step = 2
seed = 3
checkpoint_every = 1
"#
);

/// A recipe whose model cannot load: any error after the run-dir checks is about the model.
const MISSING_MODEL: &str = r#"
[model]
path = "/nonexistent/composer-model"

[data]
task = "arithmetic"
"#;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn fresh(recipe: &Path, run_dir: &Path, overwrite: bool) -> anyhow::Result<RunOutcome> {
    run_train(&TrainOptions {
        recipe_path: Some(recipe.to_path_buf()),
        quiet: true,
        run_dir_override: Some(run_dir.to_path_buf()),
        overwrite,
        ..Default::default()
    })
}

fn resume(run_dir: &Path, recipe: Option<&Path>) -> anyhow::Result<RunOutcome> {
    run_train(&TrainOptions {
        recipe_path: recipe.map(Path::to_path_buf),
        resume: Some(run_dir.to_path_buf()),
        quiet: true,
        ..Default::default()
    })
}

/// The error of `f`, which must neither succeed nor panic.
fn error_of(what: &str, f: impl FnOnce() -> anyhow::Result<RunOutcome>) -> String {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(_)) => panic!("{what}: accepted"),
        Ok(Err(e)) => format!("{e:#}"),
        Err(_) => panic!("{what}: panicked"),
    }
}

/// Damages a checkpoint directory.
type Corruption<'a> = &'a dyn Fn(&Path);

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else if e.file_name() != ".lock" {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
}

#[test]
fn fresh_run_into_a_used_run_dir_is_refused_before_the_model_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = write(tmp.path(), "missing.toml", MISSING_MODEL);
    let run = tmp.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{\"step\":1}\n").unwrap();
    let e = error_of("fresh run over a run", || fresh(&recipe, &run, false));
    assert!(
        e.contains(&run.display().to_string())
            && e.contains("--resume")
            && e.contains("--overwrite"),
        "{e}"
    );
    assert!(
        !e.contains("nonexistent"),
        "refused only after loading the model: {e}"
    );
    // The earlier run's metrics are untouched.
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl")).unwrap(),
        "{\"step\":1}\n"
    );
    // With overwrite the run goes on (and fails on the missing model).
    let e = error_of("overwrite", || fresh(&recipe, &run, true));
    assert!(e.contains("nonexistent"), "{e}");
}

/// `--overwrite` removes everything of the earlier run (so none of it can be resumed or
/// mixed into the new run's metrics) and leaves the user's own files alone.
#[test]
fn overwrite_removes_the_earlier_runs_checkpoints_and_artefacts() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = write(tmp.path(), "missing.toml", MISSING_MODEL);
    let run = tmp.path().join("run");
    for dir in ["checkpoint", "checkpoint.old", "samples"] {
        std::fs::create_dir_all(run.join(dir)).unwrap();
        std::fs::write(run.join(dir).join("x"), "old").unwrap();
    }
    for file in ["metrics.jsonl", "recipe.toml", "report.html"] {
        std::fs::write(run.join(file), "old").unwrap();
    }
    std::fs::write(run.join("notes.txt"), "mine").unwrap();
    // The run fails on the missing model, after the run dir was claimed and cleared.
    let e = error_of("overwrite", || fresh(&recipe, &run, true));
    assert!(e.contains("nonexistent"), "{e}");
    for gone in [
        "checkpoint",
        "checkpoint.old",
        "samples",
        "metrics.jsonl",
        "recipe.toml",
        "report.html",
    ] {
        assert!(!run.join(gone).exists(), "{gone} survived --overwrite");
    }
    assert_eq!(
        std::fs::read_to_string(run.join("notes.txt")).unwrap(),
        "mine"
    );
}

#[test]
fn a_run_dir_in_use_is_refused_naming_the_owner_pid() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = write(tmp.path(), "missing.toml", MISSING_MODEL);
    let run = tmp.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let held = composer_train::run_dir::lock(&run).unwrap();
    let e = error_of("second owner", || fresh(&recipe, &run, true));
    assert!(
        e.contains(&std::process::id().to_string()) && e.contains("in use"),
        "{e}"
    );
    drop(held);
    let e = error_of("after release", || fresh(&recipe, &run, true));
    assert!(e.contains("nonexistent"), "{e}");
}

#[test]
fn resume_checks_the_recipe_argument_and_survives_corrupted_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = write(tmp.path(), "recipe.toml", ONE_STEP);
    let run = tmp.path().join("run");
    fresh(&recipe, &run, false).unwrap();
    // Training into it again needs `overwrite`.
    let e = error_of("second fresh run", || fresh(&recipe, &run, false));
    assert!(e.contains("--resume"), "{e}");
    fresh(&recipe, &run, true).unwrap();

    // Item 2: a recipe with `--resume` must be the run's own.
    let other = write(
        tmp.path(),
        "other.toml",
        &ONE_STEP.replace("seed = 3", "seed = 4"),
    );
    let e = error_of("other recipe", || resume(&run, Some(&other)));
    assert!(
        e.contains("other.toml")
            && e.contains(&run.join("checkpoint/recipe.toml").display().to_string()),
        "{e}"
    );
    resume(&run, Some(&recipe)).unwrap();
    let commented = write(tmp.path(), "commented.toml", &format!("# same\n{ONE_STEP}"));
    resume(&run, Some(&commented)).unwrap();

    // Item 4: corrupted checkpoint files are errors naming the file.
    let cases: [(&str, Corruption); 3] = [
        ("model.safetensors", &|ck: &Path| {
            let p = ck.join("model.safetensors");
            let bytes = std::fs::read(&p).unwrap();
            std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
        }),
        ("optimizer.safetensors", &|ck: &Path| {
            std::fs::write(ck.join("optimizer.safetensors"), b"garbage").unwrap();
        }),
        ("optimizer.safetensors", &|ck: &Path| {
            let empty = safetensors::serialize(Vec::<(String, Tensor)>::new(), None).unwrap();
            std::fs::write(ck.join("optimizer.safetensors"), empty).unwrap();
        }),
    ];
    for (i, (file, corrupt)) in cases.iter().enumerate() {
        let dir = tmp.path().join(format!("corrupt-{i}"));
        copy_dir(&run, &dir);
        let _ = std::fs::remove_dir_all(dir.join("checkpoint.old"));
        corrupt(&dir.join("checkpoint"));
        let e = error_of(file, || resume(&dir, None));
        assert!(
            e.contains(&dir.join("checkpoint").join(file).display().to_string()),
            "case {i}: {e}"
        );
    }
}

#[test]
fn overlong_prompts_are_reported_by_file_and_line_or_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let long = "1".repeat(600);
    let rows = [
        r#"{"prompt": "1+1=", "answer": "2"}"#.to_string(),
        r#"{"prompt": "2+2=", "answer": "4"}"#.to_string(),
        format!(r#"{{"prompt": "{long}+1=", "answer": "0"}}"#),
        r#"{"prompt": "3+3=", "answer": "6"}"#.to_string(),
        r#"{"prompt": "1+2=", "answer": "3"}"#.to_string(),
    ];
    let data = write(tmp.path(), "data.jsonl", &(rows.join("\n") + "\n"));
    let recipe_text = |policy: &str| {
        ONE_STEP.replace(
            "task = \"arithmetic\"\neval_size = 10",
            &format!(
                "dataset = {:?}\neval_size = 1{policy}",
                data.display().to_string()
            ),
        )
    };
    assert!(
        recipe_text("").contains("data.jsonl"),
        "the recipe template changed"
    );
    let recipe = write(tmp.path(), "error.toml", &recipe_text(""));
    let e = error_of("overlong prompt", || {
        fresh(&recipe, &tmp.path().join("run-error"), false)
    });
    assert!(
        e.contains("data.jsonl line 3") && e.contains("overlong_prompts"),
        "{e}"
    );
    let recipe = write(
        tmp.path(),
        "skip.toml",
        &recipe_text("\noverlong_prompts = \"skip\""),
    );
    let (out, log) = logged(|| fresh(&recipe, &tmp.path().join("run-skip"), false));
    assert_eq!(out.unwrap().steps_completed, 1);
    // Row 1 is the eval row (eval_size = 1); the long row 3 is a training row.
    assert!(
        log.contains("skipped 1 training and 0 eval prompts"),
        "the skip is not reported with its count: {log}"
    );
}

/// A resumed run refuses a dataset whose bytes changed since the run started (it would train
/// on other prompts than its seed drew), naming the key and the checkpoint that recorded it;
/// with the file restored the run resumes.
#[test]
fn resume_refuses_a_dataset_that_changed_since_the_run_started() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n\
                {\"prompt\": \"2+2=\", \"answer\": \"4\"}\n\
                {\"prompt\": \"3+3=\", \"answer\": \"6\"}\n";
    let data = write(tmp.path(), "data.jsonl", rows);
    let recipe = write(
        tmp.path(),
        "recipe.toml",
        &ONE_STEP.replace(
            "task = \"arithmetic\"\neval_size = 10",
            &format!("dataset = {:?}\neval_size = 1", data.display().to_string()),
        ),
    );
    let run = tmp.path().join("run");
    fresh(&recipe, &run, false).unwrap();
    std::fs::write(
        &data,
        rows.replace("3+3=", "4+4=").replace("\"6\"", "\"8\""),
    )
    .unwrap();
    let e = error_of("edited dataset", || resume(&run, None));
    assert!(
        e.contains("`[data] dataset`")
            && e.contains("changed")
            && e.contains(&run.join("checkpoint").display().to_string()),
        "{e}"
    );
    std::fs::write(&data, rows).unwrap();
    resume(&run, None).unwrap();
}

/// A `Write` into a shared buffer, for capturing this thread's log.
#[derive(Clone, Default)]
struct LogBuffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogBuffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with this thread's `tracing` events (warn and above) captured; returns its
/// result and the log text.
fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
    let buf = LogBuffer::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .finish();
    let out = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned();
    (out, text)
}

#[test]
fn replay_trace_with_a_token_id_outside_the_vocabulary_is_refused_naming_the_line() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = |id: u32| {
        format!(
            r#"{{"teacher": "t", "prompt_ids": [1, 2], "completion_ids": [{id}], "topk_ids": [[{id}]], "topk_logprobs": [[-0.1]], "reward": 1.0, "passed": true}}"#
        )
    };
    // Line 1 is fine, line 2 blank, line 3 has an id far beyond the tiny model's vocabulary:
    // the error names line 3 (not "trace #2").
    let traces = write(
        tmp.path(),
        "traces.jsonl",
        &format!(
            "{}

{}
",
            trace(3),
            trace(100_000)
        ),
    );
    let text = format!(
        "{ONE_STEP}
[replay]
traces = [{:?}]
",
        traces.display().to_string()
    );
    let recipe = write(tmp.path(), "replay.toml", &text);
    let run = tmp.path().join("run");
    let e = error_of("trace id outside the vocabulary", || {
        fresh(&recipe, &run, false)
    });
    assert!(e.contains("traces.jsonl:3:") && e.contains("100000"), "{e}");
    assert!(e.contains("vocabulary"), "{e}");
    // Refused before training: no step ran, no checkpoint was written.
    assert!(!run.join("checkpoint").exists());
    let trained = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    assert!(!trained.contains("\"train\""), "{trained}");
}

#[test]
fn dataset_prompt_with_a_token_id_outside_the_vocabulary_is_refused_naming_the_line() {
    // Dataset rows carry text, not ids: an id outside the model's vocabulary comes from a
    // tokenizer larger than the embedding. The HF fixture's tokenizer gets one added token
    // with id = vocab_size (384), which a prompt on line 2 uses.
    let shared = std::env::var("COMPOSER_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared")));
    let fixture = shared.join("fixtures/hf-tiny/qwen2-tiny");
    if !fixture.join("config.json").is_file() {
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
        assert!(!ci, "fixture {} missing but CI is set", fixture.display());
        eprintln!("SKIPPED: fixture {} not found", fixture.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_dir(&fixture, &model);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let vocab = cfg["vocab_size"].as_u64().unwrap();
    let tok_path = model.join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    tok["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": vocab, "content": "<|beyond|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": false
        }));
    std::fs::write(&tok_path, tok.to_string()).unwrap();
    let data = write(
        tmp.path(),
        "data.jsonl",
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"<|beyond|>2+2=\", \"answer\": \"4\"}\n",
    );
    let eval = write(
        tmp.path(),
        "eval.jsonl",
        "{\"prompt\": \"3+3=\", \"answer\": \"6\"}\n",
    );
    let text = format!(
        "[model]\npath = {:?}\n[data]\ndataset = {:?}\neval_dataset = {:?}\n[rollout]\n\
         num_generations = 2\nmax_completion_length = 3\n[train]\nsteps = 1\nprompts_per_step = 1\n",
        model.display().to_string(),
        data.display().to_string(),
        eval.display().to_string()
    );
    let recipe = write(tmp.path(), "recipe.toml", &text);
    let run = tmp.path().join("run");
    let e = error_of("prompt id outside the vocabulary", || {
        fresh(&recipe, &run, false)
    });
    assert!(
        e.contains("data.jsonl line 2")
            && e.contains(&format!("token id {vocab}"))
            && e.contains("vocabulary"),
        "{e}"
    );
    assert!(!run.join("checkpoint").exists());
}

/// Unmounts the tmpfs when the test ends (pass or fail).
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

fn checkpoint_of(step: usize, floats: usize) -> (HashMap<String, Tensor>, TrainerState) {
    let w = Tensor::zeros(floats, candle_core::DType::F32, &Device::Cpu).unwrap();
    let state = TrainerState {
        step,
        policy_version: step as u64,
        optimizer_step: step as u64,
        skipped_steps: 0,
        consecutive_skipped: 0,
        samples_generated: 0,
        trained_tokens: 0,
        seed: 0,
        warmup_accuracy: None,
        data_digests: Default::default(),
    };
    (HashMap::from([("w".to_string(), w)]), state)
}

fn save(run_dir: &Path, step: usize, floats: usize) -> anyhow::Result<PathBuf> {
    let (weights, state) = checkpoint_of(step, floats);
    checkpoint::save_checkpoint(
        run_dir,
        &CheckpointData {
            config: serde_json::json!({}),
            weights,
            tokenizer_json: "{}".into(),
            optimizer: HashMap::new(),
            source_dir: None,
            adapter_config: None,
            reference: None,
            state: &state,
            recipe_text: "",
            extra_files: vec![],
        },
    )
}

#[test]
fn disk_full_while_checkpointing_keeps_the_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("fs");
    std::fs::create_dir_all(&run).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&run)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !mounted {
        // Under CI a skipped disk-full check would pass silently: fail instead.
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
        assert!(
            !ci,
            "cannot mount a 256k tmpfs on {} but CI is set (the disk-full check needs root or CAP_SYS_ADMIN)",
            run.display()
        );
        eprintln!("SKIPPED: cannot mount a tmpfs here (not root?); disk-full test skipped");
        return;
    }
    let _guard = Mounted(run.clone());
    save(&run, 1, 1024).unwrap();
    // 4 MB of weights on a 256 KB disk.
    let e = format!("{:#}", save(&run, 2, 1 << 20).unwrap_err());
    assert!(e.contains("model.safetensors"), "{e}");
    let ck = checkpoint::find_checkpoint(&run).unwrap();
    let loaded = checkpoint::load_checkpoint(&ck, &Device::Cpu).unwrap();
    assert_eq!(loaded.state.step, 1);
    let w = candle_core::safetensors::load(ck.join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(w["w"].dims(), &[1024]);
    // The partial write does not keep the disk full: the next checkpoint fits.
    assert!(!run.join("checkpoint.tmp").exists());
    save(&run, 3, 1024).unwrap();
    let ck = checkpoint::find_checkpoint(&run).unwrap();
    assert_eq!(
        checkpoint::load_checkpoint(&ck, &Device::Cpu)
            .unwrap()
            .state
            .step,
        3
    );
}

#[test]
fn env_server_down_budget_is_a_recipe_key() {
    let text = format!(
        "{ONE_STEP}\n[env]\nkind = \"builtin\"\nname = \"echo\"\nserver_down_budget_s = 5.5\n"
    );
    let r = composer_train::parse_recipe(&text, Path::new("env.toml")).unwrap();
    assert_eq!(r.env.unwrap().server_down_budget_s, 5.5);
    let bad = text.replace("= 5.5", "= 0.0");
    let e = format!(
        "{:#}",
        composer_train::parse_recipe(&bad, Path::new("env.toml")).unwrap_err()
    );
    assert!(e.contains("server_down_budget_s"), "{e}");
}
