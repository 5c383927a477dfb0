//! Shared helpers of the integration tests: fixtures → tensors, tolerance checks.
#![allow(dead_code)]
use candle_core::{DType, Device, Tensor, Var};
use serde_json::Value;

/// Load a fixture file from `tests/fixtures/`.
pub fn fixture(name: &str) -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/").to_string() + name;
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

pub fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

pub fn rows(v: &Value) -> Vec<Vec<f64>> {
    v.as_array().expect("array").iter().map(f64s).collect()
}

pub fn t1(v: &Value, dt: DType) -> Tensor {
    let x = f64s(v);
    Tensor::from_vec(x.clone(), x.len(), &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

pub fn t2(v: &Value, dt: DType) -> Tensor {
    let r = rows(v);
    let (b, t) = (r.len(), r[0].len());
    Tensor::from_vec(r.concat(), (b, t), &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

pub fn t3(v: &Value, dt: DType) -> Tensor {
    let r: Vec<Vec<Vec<f64>>> = v.as_array().unwrap().iter().map(rows).collect();
    let (b, t, k) = (r.len(), r[0].len(), r[0][0].len());
    let flat: Vec<f64> = r.into_iter().flatten().flatten().collect();
    Tensor::from_vec(flat, (b, t, k), &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

pub fn var2(v: &Value, dt: DType) -> Var {
    Var::from_tensor(&t2(v, dt)).unwrap()
}

pub fn var3(v: &Value, dt: DType) -> Var {
    Var::from_tensor(&t3(v, dt)).unwrap()
}

/// Tolerance for a dtype: 1e-6 in f64, 1e-5 in f32 (relative above magnitude 1).
pub fn tol(dt: DType) -> f64 {
    if dt == DType::F64 {
        1e-6
    } else {
        1e-5
    }
}

pub fn close(got: f64, want: f64, dt: DType) -> bool {
    (got - want).abs() <= tol(dt) * want.abs().max(1.0)
}

pub fn assert_close(what: &str, got: f64, want: f64, dt: DType) {
    assert!(
        close(got, want, dt),
        "{what} ({dt:?}): got {got}, want {want}, diff {}",
        (got - want).abs()
    );
}

pub fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

pub fn assert_all_close(what: &str, got: &[f64], want: &[f64], dt: DType) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(close(*g, *w, dt), "{what}[{i}] ({dt:?}): got {g}, want {w}");
    }
}

pub fn flatten_value(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a.iter().flat_map(flatten_value).collect(),
        Value::Number(n) => vec![n.as_f64().unwrap()],
        _ => panic!("not numeric: {v}"),
    }
}
