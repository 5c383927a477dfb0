//! `record-traces`: the trace store format, and bad flags / rows refused before the file is
//! touched.

use super::*;

#[test]
fn record_traces_writes_the_trace_store_format() {
    use composer_train::record_traces::{record_traces, RecordTracesOptions};
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    hf_recipe(tmp.path(), &model);
    let out = tmp.path().join("traces.jsonl");
    let summary = record_traces(&RecordTracesOptions {
        model_dir: model.clone(),
        data: tmp.path().join("data.jsonl"),
        out: out.clone(),
        append: false,
        teacher: None,
        num_samples: 2,
        top_k: 4,
        max_new_tokens: 5,
        temperature: 1.0,
        seed: 1,
        verifier: "numeric".into(),
        verifier_pattern: None,
        device: "cpu".into(),
    })
    .unwrap();
    assert_eq!(summary.traces, 4);
    let store = composer_loss::TraceStore::load(&out).unwrap();
    assert_eq!(store.traces.len(), 4);
    let rendered = reference("qwen2-tiny")["chat_template_example"]["rendered"]
        .as_str()
        .unwrap()
        .to_string();
    let tok = composer_model::Tokenizer::from_dir(&model).unwrap();
    for t in &store.traces {
        assert_eq!(t.teacher, "qwen2-tiny");
        assert_eq!(t.prompt_ids, tok.encode(&rendered).unwrap());
        assert_eq!(t.topk_ids.len(), t.completion_ids.len());
        assert!(t.topk_ids.iter().all(|k| k.len() == 4));
        // Sorted by decreasing log-prob, all ≤ 0.
        for lp in &t.topk_logprobs {
            assert!(lp.windows(2).all(|w| w[0] >= w[1]) && lp[0] <= 0.0);
        }
    }
}

/// Bad flags and bad rows are refused before the trace file is touched, naming the flag or the
/// row, and a recording that fails leaves the file as it was (also with `--append`).
#[test]
fn record_traces_refuses_bad_input_and_keeps_the_file() {
    use composer_train::record_traces::{record_traces, RecordTracesOptions};
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    hf_recipe(tmp.path(), &model);
    let out = tmp.path().join("traces.jsonl");
    let good = RecordTracesOptions {
        model_dir: model.clone(),
        data: tmp.path().join("data.jsonl"),
        out: out.clone(),
        append: false,
        teacher: None,
        num_samples: 1,
        top_k: 2,
        max_new_tokens: 3,
        temperature: 1.0,
        seed: 1,
        verifier: "numeric".into(),
        verifier_pattern: None,
        device: "cpu".into(),
    };
    record_traces(&good).unwrap();
    let kept = std::fs::read(&out).unwrap();
    assert!(!kept.is_empty());
    // A dataset whose second row is empty.
    let rows = tmp.path().join("empty_row.jsonl");
    std::fs::write(
        &rows,
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"\", \"answer\": \"1\"}\n",
    )
    .unwrap();
    let cases: Vec<(RecordTracesOptions, &str)> = vec![
        (
            RecordTracesOptions {
                temperature: -1.0,
                ..good.clone()
            },
            "--temperature",
        ),
        (
            RecordTracesOptions {
                temperature: f64::NAN,
                ..good.clone()
            },
            "--temperature",
        ),
        (
            RecordTracesOptions {
                top_k: 0,
                ..good.clone()
            },
            "--top-k",
        ),
        (
            RecordTracesOptions {
                top_k: 1 << 30,
                ..good.clone()
            },
            "--top-k",
        ),
        (
            RecordTracesOptions {
                max_new_tokens: 0,
                ..good.clone()
            },
            "--max-new-tokens",
        ),
        (
            RecordTracesOptions {
                num_samples: 0,
                ..good.clone()
            },
            "--num-samples",
        ),
        (
            RecordTracesOptions {
                verifier: "regex".into(),
                ..good.clone()
            },
            "pattern",
        ),
        (
            RecordTracesOptions {
                verifier: "regex".into(),
                verifier_pattern: Some("(".into()),
                ..good.clone()
            },
            "pattern",
        ),
        (
            RecordTracesOptions {
                data: rows.clone(),
                ..good.clone()
            },
            "row 2",
        ),
        (
            RecordTracesOptions {
                data: rows.clone(),
                append: true,
                ..good.clone()
            },
            "row 2",
        ),
    ];
    for (o, named) in cases {
        let e = format!("{:#}", record_traces(&o).unwrap_err());
        assert!(e.contains(named), "expected {named:?} in: {e}");
        assert_eq!(std::fs::read(&out).unwrap(), kept, "{e}: the file changed");
    }
    // Appending adds to what is there.
    let before = composer_loss::TraceStore::load(&out).unwrap().traces.len();
    record_traces(&RecordTracesOptions {
        append: true,
        ..good.clone()
    })
    .unwrap();
    let after = composer_loss::TraceStore::load(&out).unwrap().traces.len();
    assert_eq!(after, 2 * before);
}
