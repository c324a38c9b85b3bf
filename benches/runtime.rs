//! Criterion benches for the runtime, with libpython embedded: the call path and per-node
//! dispatch; and kwexport's own kernels, which need no Python. (Parse + validate and
//! binding alone are the core's: `benches/validate.rs`.)
//!
//!     PYO3_PYTHON=.venv/bin/python cargo bench -p kwexport-runtime --bench runtime
//!
//! The Python benches import torch and kwexport's exporter from `.venv` and `python/`
//! (after `bash scripts/setup.sh`); without them they are skipped with a note.

use std::path::{Path, PathBuf};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kwexport_runtime::plan::Dispatch;
use kwexport_runtime::program::{load, LoadOptions, Program};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// Embedded Python with the project's venv and exporter importable; `None` (and a note) if
/// torch can't be imported.
fn python_ready(py: Python<'_>) -> Option<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let sys = py.import("sys").ok()?;
    let path = sys.getattr("path").ok()?;
    let version: (u8, u8) =
        sys.getattr("version_info").ok()?.extract::<(u8, u8, u8, String, u8)>().ok().map(|v| (v.0, v.1))?;
    let site = root.join(format!(".venv/lib/python{}.{}/site-packages", version.0, version.1));
    for p in [site, root.join("python"), root.join("benches")] {
        path.call_method1("insert", (0, p.to_str()?)).ok()?;
    }
    match py.import("torch") {
        Ok(torch) => {
            torch.call_method1("set_num_threads", (1,)).ok()?;
            Some(())
        }
        Err(e) => {
            eprintln!("skipping the Python benches: cannot import torch ({e}); run scripts/setup.sh");
            None
        }
    }
}

/// Exports `code`'s `f(*args, **kwargs)` to a file in `dir` and returns the path, args and kwargs.
fn export<'py>(
    py: Python<'py>,
    dir: &Path,
    name: &str,
    code: &str,
) -> PyResult<(PathBuf, Bound<'py, PyTuple>, Bound<'py, PyDict>)> {
    let ns = PyDict::new(py);
    let code = std::ffi::CString::new(code).unwrap();
    py.run(&code, Some(&ns), Some(&ns))?;
    let path = dir.join(format!("{name}.kwx"));
    let kwexport = py.import("kwexport")?;
    let get = |k: &str| ns.as_any().get_item(k);
    let ex = kwexport.call_method1("export", (get("f")?, get("args")?, get("kwargs")?))?;
    kwexport.call_method1("save", (ex, &path))?;
    Ok((path, get("args")?.cast_into()?, get("kwargs")?.cast_into()?))
}

fn load_as(py: Python<'_>, path: &Path, dispatch: Dispatch) -> PyResult<Program> {
    Ok(load(
        py,
        path.to_str().unwrap(),
        &LoadOptions::new(Vec::new(), dispatch, None, true, kwexport_core::passes::Level::Exact, false).unwrap(),
    )?)
}

/// Binding the call to the signature, flattening it against the treespec and checking
/// every leaf: the whole call path but the graph.
fn bind_flatten_check(c: &mut Criterion) {
    Python::initialize();
    Python::attach(|py| {
        python_ready(py)?;
        let dir = tempdir();
        let mut group = c.benchmark_group("bind_flatten_check");
        for name in ["two_op", "kwargs_mlp", "deep_mlp"] {
            let code = format!("import workloads\nf, args, kwargs = workloads.build({name:?})\n");
            let (path, args, kwargs) = export(py, &dir, name, &code).expect("export");
            let prog = load_as(py, &path, Dispatch::Auto).expect("load");
            group.bench_function(name, |b| b.iter(|| prog._flatten(&args, Some(&kwargs)).unwrap()));
        }
        group.finish();
        Some(())
    });
}

/// One node's cost on each path: a chain of 256 `relu`s on a small tensor, run on flat
/// leaves (no binding or checks), reported per node.
fn per_node_dispatch(c: &mut Criterion) {
    Python::initialize();
    Python::attach(|py| {
        python_ready(py)?;
        let dir = tempdir();
        let code = "import torch\n\
                    def f(x):\n    for _ in range(256):\n        x = torch.relu(x)\n    return x\n\
                    args, kwargs = (torch.randn(4, 16),), {}\n";
        let (path, args, _) = export(py, &dir, "relu_chain", code).expect("export");
        let mut group = c.benchmark_group("dispatch_per_node");
        group.throughput(Throughput::Elements(256));
        for (label, dispatch) in [("stable_abi", Dispatch::Abi), ("python_op", Dispatch::Python)] {
            let prog = load_as(py, &path, dispatch).expect("load");
            let leaves: Vec<Bound<'_, PyAny>> = args.iter().collect();
            group.bench_function(label, |b| b.iter(|| prog._run_flat(leaves.clone()).unwrap()));
        }
        group.finish();
        Some(())
    });
}

/// kwexport's own kernels on plain slices, at the shapes `optimize="fast"` gives them: GELU
/// over an MLP's activations, the small-batch linear at a decode step and at 32 tokens (in
/// float32, bfloat16 and int8), and
/// the convolutions of mobilenet_v3_small at 224×224 (1×1 as a GEMM over pixels, depthwise,
/// and the RGB stem), resnet18's max pooling and a small transformer's attention.
fn kernels(c: &mut Criterion) {
    use kwexport_runtime::kernels::{
        attention_f32, depthwise_f32, direct_f32, gelu_f32, gemm_f32, indirect_f32, linear_f32, max_pool_f32,
        Attention, AttentionMask, Conv2d, Depthwise, Epilogue, MaxPool,
    };
    let data = |n: usize| (0..n).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<f32>>();
    let mut group = c.benchmark_group("kernels");
    for n in [4 * 256, 32 * 1024] {
        let (x, mut out) = (data(n), vec![0.0; n]);
        group.throughput(Throughput::Elements(n as u64));
        for (name, tanh) in [("gelu", false), ("gelu_tanh", true)] {
            group.bench_function(format!("{name}/{n}"), |b| b.iter(|| gelu_f32(&x, tanh, &mut out)));
        }
    }
    for (m, k, n) in [(1, 256, 256), (4, 256, 256), (32, 256, 1024), (32, 1024, 256)] {
        let (x, wt, bias, mut out) = (data(m * k), data(k * n), data(n), vec![0.0; m * n]);
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        group.bench_function(format!("linear/{m}x{k}x{n}"), |b| {
            b.iter(|| linear_f32(&x, m, k, &wt, n, Some(&bias), &mut out))
        });
    }
    // The same linears on the bfloat16 GEMM (`precision="bf16"`), rounding the rows included.
    for (m, k, n) in [(1, 256, 256), (4, 256, 256), (32, 256, 1024), (32, 1024, 256)] {
        use kwexport_runtime::kernels::bf16;
        let (x, bias, mut out) = (data(m * k), data(n), vec![0.0; m * n]);
        let mut panels = vec![0u32; n.div_ceil(64) * k.div_ceil(2) * 64];
        bf16::pack_panels(&data(n * k), [n, k, 1, 1], [k, 1, 0, 0], &mut panels);
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        group.bench_function(format!("linear_bf16/{m}x{k}x{n}"), |b| {
            b.iter(|| bf16::gemm(&x, m, k, &panels, n, Some(&bias), None, Epilogue::None, &mut out))
        });
    }
    // The same linears and a BERT-base one on the int8 GEMM (pt2e's static activation
    // scale), in the layout this CPU's kernel packs the weight in for 256 input levels and
    // for 128 (`reduce_range`, `vpmaddubsw`'s quads without VNNI); quantizing the rows included.
    {
        use kwexport_runtime::kernels::int8::{linear, peak, Layout, Packed, Quant};
        let full = Quant { scale: 0.02, zero_point: 128, qmin: 0, qmax: 255 };
        let reduced = Quant { zero_point: 64, qmax: 127, ..full };
        for (m, k, n) in [(1, 256, 256), (4, 256, 256), (32, 256, 1024), (32, 1024, 256), (128, 768, 768)] {
            let (x, bias, scale, mut out) = (data(m * k), data(n), vec![0.01; n], vec![0.0; m * n]);
            let w: Vec<i8> = (0..n * k).map(|i| (i * 37 % 255) as u8 as i8).collect();
            let peak = peak(w.iter().copied());
            for (levels, quant) in [("256", full), ("128", reduced)] {
                let Some(layout) = Layout::choose(quant.qmax - quant.qmin, peak) else { break };
                let mut words = vec![0u32; layout.packed_len([n, k])];
                layout.pack(&w, [n, k], [k, 1], &mut words);
                let weight = Packed { words: &words, layout, peak };
                group.throughput(Throughput::Elements((2 * m * k * n) as u64));
                let name = format!("linear_int8_{layout:?}_{levels}/{m}x{k}x{n}").to_lowercase();
                group.bench_function(name, |b| {
                    b.iter(|| {
                        linear(
                            (&x, k),
                            [m, k, n],
                            &quant,
                            weight,
                            &scale,
                            Some(&bias),
                            (Epilogue::None, None),
                            &mut out,
                        )
                    })
                });
            }
        }
    }
    // A fused linear's activation, as the GEMM stores (BERT's and Llama's MLPs).
    let (m, k, n) = (32, 256, 1024);
    let (x, wt, mut out) = (data(m * k), data(k * n), vec![0.0; m * n]);
    group.throughput(Throughput::Elements((2 * m * k * n) as u64));
    for (name, epilogue) in [("gelu", Epilogue::Gelu), ("swish", Epilogue::Swish)] {
        group.bench_function(format!("linear_{name}/{m}x{k}x{n}"), |b| {
            b.iter(|| gemm_f32(&x, m, k, &wt, n, None, None, epilogue, &mut out))
        });
    }
    for (m, k, n) in [(3136usize, 16usize, 72usize), (784, 72, 24), (196, 40, 240), (49, 576, 96)] {
        let (x, wt, bias, mut out) = (data(m * k), data(k * n.div_ceil(64) * 64), data(n), vec![0.0; m * n]);
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        group.bench_function(format!("conv1x1/{m}x{k}x{n}"), |b| {
            b.iter(|| gemm_f32(&x, m, k, &wt, n, Some(&bias), None, Epilogue::Hardswish, &mut out))
        });
    }
    for (ch, k, s, size) in
        [(72, 3, 2, 56), (240, 5, 1, 14), (576, 5, 1, 7), (96, 3, 2, 112), (144, 3, 1, 56), (384, 3, 1, 14)]
    {
        let g = Depthwise::new([ch as i64, k as i64, k as i64], [s as i64; 2], [(k / 2) as i64; 2]).unwrap();
        let [ho, wo] = g.output(size, size).unwrap();
        let (x, taps, bias, mut out) = (data(size * size * ch), data(k * k * ch), data(ch), vec![0.0; ho * wo * ch]);
        group.throughput(Throughput::Elements((2 * ho * wo * ch * k * k) as u64));
        group.bench_function(format!("depthwise/{ch}x{size}x{size}/k{k}s{s}"), |b| {
            b.iter(|| depthwise_f32(&x, [1, size, size], &taps, &g, Some(&bias), Epilogue::Relu, &mut out))
        });
    }
    for (ch, size) in [(64usize, 56usize), (256, 14), (512, 7), (512, 2), (128, 8), (256, 4)] {
        let g = Conv2d::new([ch as i64, ch as i64, 3, 3], [1, 1], [1, 1]).unwrap();
        let k = ch * 9;
        let (x, panels, bias) = (data(size * size * ch), data(k * ch), data(ch));
        let mut out = vec![0.0; size * size * ch];
        group.throughput(Throughput::Elements((2 * size * size * ch * k) as u64));
        group.bench_function(format!("indirect/{ch}x{size}x{size}/k3"), |b| {
            b.iter(|| indirect_f32(&x, [1, size, size], &panels, &g, Some(&bias), None, Epilogue::Relu, &mut out))
        });
        // By Winograd's F(2×2, 3×3), transforms included.
        let mut wino = vec![0.0; kwexport_runtime::kernels::winograd::panels_len(ch, ch)];
        kwexport_runtime::kernels::winograd::pack_weights(&data(k * ch), [ch, ch], [k, 9, 3, 1], &mut wino);
        group.bench_function(format!("winograd/{ch}x{size}x{size}/k3"), |b| {
            b.iter(|| {
                let g = &g;
                kwexport_runtime::kernels::winograd::conv(
                    &x,
                    [1, size, size],
                    &wino,
                    g,
                    Some(&bias),
                    None,
                    Epilogue::Relu,
                    &mut out,
                )
            })
        });
        // The same in bfloat16 (`precision="bf16"`), rounding the input included.
        let mut pairs = vec![0u32; ch.div_ceil(64) * 9 * ch.div_ceil(2) * 64];
        kwexport_runtime::kernels::bf16::pack_panels(&data(k * ch), [ch, ch, 3, 3], [k, 9, 3, 1], &mut pairs);
        group.bench_function(format!("indirect_bf16/{ch}x{size}x{size}/k3"), |b| {
            b.iter(|| {
                kwexport_runtime::kernels::bf16::indirect(
                    &x,
                    [1, size, size],
                    &pairs,
                    &g,
                    Some(&bias),
                    None,
                    Epilogue::Relu,
                    &mut out,
                )
            })
        });
    }
    let g = Conv2d::new([16, 3, 3, 3], [2, 2], [1, 1]).unwrap();
    let [ho, wo] = g.output(224, 224).unwrap();
    let (x, taps, bias, mut out) = (data(3 * 224 * 224), data(27 * 16), data(16), vec![0.0; ho * wo * 16]);
    group.throughput(Throughput::Elements((2 * ho * wo * 16 * 27) as u64));
    group.bench_function("direct/3x224x224/k3s2", |b| {
        let nchw = [3 * 224 * 224, 224 * 224, 224, 1];
        b.iter(|| direct_f32(&x, [1, 224, 224], nchw, &taps, &g, Some(&bias), Epilogue::Hardswish, &mut out))
    });
    // resnet18's max pooling after its stem, at a 64×64 input.
    let pool = MaxPool { kernel: [3, 3], stride: [2, 2], padding: [1, 1], ceil: false };
    let (x, mut out) = (data(32 * 32 * 64), vec![0.0; 16 * 16 * 64]);
    group.throughput(Throughput::Elements((16 * 16 * 64 * 9) as u64));
    group.bench_function("max_pool/64x32x32/k3s2", |b| b.iter(|| max_pool_f32(&x, [1, 32, 32, 64], &pool, &mut out)));
    // Attention over a small model's 32 tokens and an encoder's 128 and 512 (4 heads of 64,
    // read as the transposed views of a 256-wide projection), and ViT-Tiny's 3 heads over 197
    // tokens (views of its `qkv` projection, rows 3 × 192 apart).
    for (heads, l, row) in [(4usize, 32usize, 256usize), (4, 128, 256), (4, 512, 256), (3, 197, 576)] {
        let e = 64usize;
        let g = Attention { batch: 1, heads, l, s: l, e, ev: e, scale: 0.125 };
        let strides = [l * row, e, row];
        let (q, k, v, mut out) = (data(l * row), data(l * row), data(l * row), vec![0.0; l * row]);
        group.throughput(Throughput::Elements((4 * heads * l * l * e) as u64));
        for (name, mask) in [("none", AttentionMask::None), ("causal", AttentionMask::Causal)] {
            group.bench_function(format!("attention/{heads}x{l}x{e}/{name}"), |b| {
                b.iter(|| attention_f32((&q, strides), (&k, strides), (&v, strides), &g, mask, (&mut out, strides)))
            });
        }
    }
    group.finish();
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kwexport-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

criterion_group!(benches, bind_flatten_check, per_node_dispatch, kernels);
criterion_main!(benches);
