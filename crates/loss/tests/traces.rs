//! The JSONL trace store: round trips, lookups, collation, and bad files whose errors name the
//! file and the 1-based line.
use candle_core::{DType, Device};
use composer_loss::*;
use std::io::Write;

fn trace(teacher: &str, prompt: &[u32], passed: bool) -> Trace {
    Trace {
        teacher: teacher.into(),
        prompt_ids: prompt.to_vec(),
        completion_ids: vec![4, 5, 6],
        topk_ids: vec![vec![4, 9], vec![7, 5], vec![1, 2]],
        topk_logprobs: vec![vec![-0.1, -2.5], vec![-0.5, -1.0], vec![-0.7, -0.9]],
        reward: if passed { 1.0 } else { 0.0 },
        passed,
        loss_mask: None,
        tokenizer: None,
    }
}

#[test]
fn write_load_round_trip_and_lookups() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("traces.jsonl");
    let mut w = TraceWriter::create(&path).unwrap();
    w.write(&trace("qwen-7b", &[1, 2], true)).unwrap();
    w.write(&trace("llama-8b", &[1, 2], false)).unwrap();
    w.flush().unwrap();
    drop(w);
    let mut w = TraceWriter::append(&path).unwrap();
    w.write(&trace("qwen-7b", &[3], true)).unwrap();
    w.flush().unwrap();
    drop(w);

    let store = TraceStore::load(&path).unwrap();
    assert_eq!(store.len(), 3);
    assert_eq!(store.traces[0], trace("qwen-7b", &[1, 2], true));
    assert_eq!(store.teachers(), ["llama-8b", "qwen-7b"]);
    assert_eq!(store.for_prompt(&[1, 2]).count(), 2);
    assert_eq!(store.passing_for_prompt(&[1, 2]).count(), 1);
    assert_eq!(store.for_prompt(&[9]).count(), 0);
    // Token 4 is in position 0's top-K, 5 in position 1's, 6 in none of position 2's.
    assert_eq!(store.traces[0].recorded_token_logprobs(), None);
    let mut t = trace("x", &[1], true);
    t.completion_ids = vec![4, 5, 2];
    assert_eq!(t.recorded_token_logprobs(), Some(vec![-0.1, -1.0, -0.9]));
}

#[test]
fn collate_pads_and_masks() {
    let a = trace("a", &[1], true);
    let mut b = trace("b", &[1], true);
    b.completion_ids.truncate(1);
    b.topk_ids.truncate(1);
    b.topk_logprobs.truncate(1);
    let batch = collate_topk(&[&a, &b], &Device::Cpu, DType::F64).unwrap();
    assert_eq!(batch.topk_ids.dims(), [2, 3, 2]);
    assert_eq!(
        batch.loss_mask.to_vec2::<f64>().unwrap(),
        [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    );
    let lp = batch.teacher_topk_logprobs.to_vec3::<f64>().unwrap();
    assert!((lp[0][1][1] - (-1.0)).abs() < 1e-7);
    assert_eq!(lp[1][2], [0.0, 0.0]);
    assert_eq!(batch.teachers, ["a", "b"]);
    let mut c = trace("c", &[1], true);
    c.topk_ids = vec![vec![1]; 3];
    c.topk_logprobs = vec![vec![-0.1]; 3];
    let err = collate_topk(&[&a, &c], &Device::Cpu, DType::F32).unwrap_err();
    assert!(err.to_string().contains("trace 1 has K = 1"), "{err}");
}

#[test]
fn loss_mask_masks_environment_tokens_and_round_trips() {
    // A multi-turn teacher episode: position 1 is a tool result, never trained on.
    let mut a = trace("a", &[1], true);
    a.loss_mask = Some(vec![1, 0, 1]);
    let batch = collate_topk(&[&a], &Device::Cpu, DType::F64).unwrap();
    assert_eq!(batch.loss_mask.to_vec2::<f64>().unwrap(), [[1.0, 0.0, 1.0]]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.jsonl");
    let mut w = TraceWriter::create(&path).unwrap();
    w.write(&a).unwrap();
    w.write(&trace("b", &[1], true)).unwrap();
    w.flush().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    // A trace without a mask is written as before (older readers still read it).
    assert!(
        !text.lines().nth(1).unwrap().contains("loss_mask"),
        "{text}"
    );
    let store = TraceStore::load(&path).unwrap();
    assert_eq!(store.traces[0].loss_mask.as_deref(), Some(&[1u8, 0, 1][..]));
    assert_eq!(store.traces[1].loss_mask, None);
    // Bad masks are refused with the field named.
    for (mask, what) in [
        (vec![1, 0], "has 2 entries"),
        (vec![1, 2, 1], "0 or 1"),
        (vec![0, 0, 0], "masks every position"),
    ] {
        let mut t = trace("t", &[1], true);
        t.loss_mask = Some(mask);
        let err = t.validate().unwrap_err();
        assert!(err.contains("loss_mask") || err.contains(what), "{err}");
        assert!(err.contains(what), "{err}");
    }
}

/// Write `lines` to a file and return the load error.
fn load_err(lines: &[&str]) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    for l in lines {
        writeln!(f, "{l}").unwrap();
    }
    drop(f);
    let err = TraceStore::load(&path).unwrap_err().to_string();
    (path.display().to_string(), err)
}

#[test]
fn bad_files_name_the_file_and_line() {
    let good = serde_json::to_string(&trace("t", &[1], true)).unwrap();
    let cases: Vec<(Vec<String>, usize, &str)> = vec![
        (
            vec![good.clone(), String::new(), "{not json".into()],
            3,
            "key must be a string",
        ),
        (
            vec![good.replace("\"passed\"", "\"pased\"")],
            1,
            "unknown field `pased`",
        ),
        (
            vec![good.replace("\"teacher\":\"t\",", "")],
            1,
            "missing field `teacher`",
        ),
        (
            vec![good.replace("\"teacher\":\"t\"", "\"teacher\":\"\"")],
            1,
            "`teacher` is empty",
        ),
        (
            vec![
                good.clone(),
                good.replace("[[4,9],[7,5],[1,2]]", "[[4,9],[7,5]]"),
            ],
            2,
            "`topk_ids` has 2 rows",
        ),
        (
            vec![good.replace("[-0.5,-1.0]", "[0.5,-1.0]")],
            1,
            "not a finite log-probability",
        ),
        (
            vec![good.replace("[-0.5,-1.0]", "[-0.01,-0.02]")],
            1,
            "sum to probability",
        ),
        (vec![good.replace("[1,2]]", "[1]]")], 1, "expected K = 2"),
    ];
    for (lines, line, msg) in cases {
        let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (path, err) = load_err(&refs);
        assert!(
            err.starts_with(&format!("{path}:{line}: ")),
            "wanted {path}:{line}: in {err}"
        );
        assert!(err.contains(msg), "wanted {msg:?} in {err}");
    }
    let err = TraceStore::load("/nonexistent/dir/traces.jsonl").unwrap_err();
    assert!(
        err.to_string().contains("/nonexistent/dir/traces.jsonl"),
        "{err}"
    );
}

#[test]
fn writer_refuses_invalid_traces() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.jsonl");
    let mut w = TraceWriter::create(&path).unwrap();
    let mut t = trace("t", &[1], true);
    t.topk_logprobs[0][0] = f32::NAN;
    let err = w.write(&t).unwrap_err().to_string();
    assert!(
        err.contains("w.jsonl") && err.contains("topk_logprobs"),
        "{err}"
    );
    w.flush().unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
}
