//! Criterion benches for the core alone (no Python): parse + validate by graph size, and
//! binding a call to a signature.
//!
//!     cargo bench -p kwexport-core --bench validate

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kwexport_core::binder::Binder;
use kwexport_core::schema::{Constant, Param, ParamKind, Signature};
use serde_json::json;

/// A valid file whose graph is a chain of `n` neg nodes on one input.
fn chain_file(n: usize) -> Vec<u8> {
    let mut nodes = Vec::with_capacity(n);
    let mut prev = "x".to_owned();
    for i in 0..n {
        let name = format!("v{i}");
        nodes.push(json!({"op": 0, "args": [{"ref": prev}], "outputs": {"one": name}}));
        prev = name;
    }
    let header = json!({
        "format_version": {"major": 3, "minor": 0},
        "producer": {"kwexport": "bench", "torch": "bench"},
        "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
        "inputs": {"spec": {"type": "tuple", "children": [{"type": "tuple", "children": [{"type": "leaf"}]}, {"type": "dict", "entries": []}]},
                   "leaves": [{"tensor": {"dtype": "float32", "device": "cpu", "shape": [{"static": 4}]}}]},
        "outputs": {"type": "leaf"},
        "ops": [{"name": "aten::neg.default", "schema": "aten::neg(Tensor self) -> Tensor"}],
        "graph": {"inputs": [{"name": "x", "source": {"user": 0}}], "nodes": nodes, "outputs": [{"ref": prev}]},
        "weights": {"storages": [], "tensors": {}}
    });
    let blob = serde_json::to_vec(&header).unwrap();
    let mut file = kwexport_core::tables::MAGIC.to_vec();
    file.extend((blob.len() as u64).to_le_bytes());
    file.extend(blob);
    file
}

fn parse_and_validate(c: &mut Criterion) {
    let mut group = c.benchmark_group("parse_validate");
    for n in [10, 100, 1000, 10000] {
        let file = chain_file(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &file, |b, f| {
            b.iter(|| kwexport_core::validate(f).unwrap())
        });
    }
    group.finish();
}

fn bind(c: &mut Criterion) {
    let p = |name: &str, kind, default: bool| Param {
        name: name.into(),
        kind,
        default: default.then_some(Constant::Int(1)),
        default_weight: None,
    };
    let binder = Binder::new(&Signature {
        name: "forward".into(),
        params: vec![
            p("x", ParamKind::PositionalOrKeyword, false),
            p("extra", ParamKind::VarPositional, false),
            p("scale", ParamKind::KeywordOnly, false),
            p("bias", ParamKind::KeywordOnly, true),
            p("temperature", ParamKind::KeywordOnly, true),
            p("cfg", ParamKind::VarKeyword, false),
        ],
    })
    .unwrap();
    c.bench_function("bind/kwargs_mlp", |b| b.iter(|| binder.bind(2, &["scale", "bias", "shift"]).unwrap()));
}

criterion_group!(benches, parse_and_validate, bind);
criterion_main!(benches);
