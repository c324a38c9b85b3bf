"""kwexport beside torch.export and TorchScript, on the same workloads, in one run.

    python benches/compare.py [--quick] [--out BENCHMARKS.md]

For each workload: load in a fresh process (after `import torch`, until the first call
returns), warm load, call time (kwexport with its default dispatch and with every node
through torch's Python ops), the call path's overhead above the floor (the same plan run on
flat inputs with no checks and no pytree work), throughput with one and two threads calling
one Program, RSS growth on load, and how four processes loading one file share its pages.
Ratios are torch.export / kwexport: above 1 means kwexport is faster. torch uses one
intra-op thread throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import workloads  # noqa: E402

import kwexport  # noqa: E402


def interleaved(fns, n, rounds=5, warmup=10):
    """Per-call time of each function, measured in turns so that a burst of noise on a
    shared machine hits all of them alike: the lowest per-round median of each."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            if f is not None:
                best[k] = min(best[k], median_time(f, max(3, n // rounds), warmup))
    return {k: (None if fns[k] is None else v) for k, v in best.items()}


def median_time(f, n, warmup=20):
    for _ in range(warmup):
        f()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


COLD = textwrap.dedent("""
    import sys, time, json, os
    import torch
    torch.set_num_threads(1)
    kind, path = sys.argv[1], sys.argv[2]
    for module in sys.argv[3:]:
        __import__(module)
    args, kwargs = torch.load(path + ".inputs", weights_only=True)
    rss0 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    t = time.perf_counter()
    if kind == "kwexport":
        import kwexport
        f = kwexport.load(path)
    elif kind == "torch.export":
        f = torch.export.load(path).module()
    else:
        f = torch.jit.load(path)
    loaded = time.perf_counter()
    with torch.no_grad():
        f(*args, **kwargs)
    done = time.perf_counter()
    rss1 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(json.dumps({"cold": done - t, "load_only": loaded - t, "rss": rss1 - rss0}))
""")


SHARER = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    kind, path = sys.argv[1], sys.argv[2]
    args, kwargs = torch.load(path + ".inputs", weights_only=True)
    import kwexport
    f = kwexport.load(path) if kind == "kwexport" else torch.export.load(path).module()
    with torch.no_grad():
        f(*args, **kwargs)
    print("ready", flush=True)
    sys.stdin.readline()
""")


def mapped_kb(pid, path):
    """(RSS, PSS) in kB of a process's mappings of `path`."""
    rss = pss = 0
    current = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                current = fields[5] if len(fields) > 5 else None
            elif current == path and fields[0] == "Rss:":
                rss += int(fields[1])
            elif current == path and fields[0] == "Pss:":
                pss += int(fields[1])
    return rss, pss


def shared_pages(path, n=4):
    """Four processes load the same kwexport file and call it once; while all are alive,
    the resident pages of the file in each, and each one's proportional share of them."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARER, "kwexport", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        sizes = [mapped_kb(p.pid, os.path.realpath(path)) for p in procs]
    finally:
        for p in procs:
            p.communicate("\n")
    return {
        "rss_mb": statistics.mean(r for r, _ in sizes) / 1024,
        "pss_mb": statistics.mean(p for _, p in sizes) / 1024,
        "n": n,
    }


def throughput(f, threads, seconds=1.5):
    """Calls per second with `threads` threads calling `f` together."""
    import threading

    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def work(i):
        with torch.no_grad():
            while time.perf_counter() < stop:
                f()
                counts[i] += 1

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def cold(kind, path, repeats, preimport=()):
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", COLD, kind, path, *preimport], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{kind} cold run failed: {out.stderr[-2000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


class _Fn(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, *args, **kwargs):
        return self.f(*args, **kwargs)


def onnx_runtime(mod, args, kwargs, path):
    """ONNX Runtime's `session.run` on inputs prepared once (its best case: no conversion per
    call), one intra-op thread; `None` where the model doesn't export to ONNX or the optional
    `bench` extra (onnxruntime, onnx, onnxscript) isn't installed."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    try:
        torch.onnx.export(mod, args, path, kwargs=kwargs, dynamo=True, verbose=False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # the exporter refuses some graphs
        print(f"ONNX: {type(e).__name__}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
        return None
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    names = [i.name for i in sess.get_inputs()]
    if len(names) != len(tensors):
        print(f"ONNX: {len(names)} inputs for {len(tensors)} tensors", file=sys.stderr)
        return None
    feeds = {n: t.numpy() for n, t in zip(names, tensors)}
    return lambda: sess.run(None, feeds)


def bench(name, tmp, quick):
    f, args, kwargs = workloads.build(name)
    mod = f if isinstance(f, torch.nn.Module) else _Fn(f)
    n_calls = {"deep_mlp": 100, "transformer": 50, "convnet": 100, "resnet18": 50, "gpt2": 100}.get(name, 3000)
    n_loads = 5 if name in ("deep_mlp", "transformer") else 20
    if quick:
        n_calls, n_loads = max(10, n_calls // 10), 3
    row = {"workload": name}

    kw_path = os.path.join(tmp, f"{name}.kwx")
    te_path = os.path.join(tmp, f"{name}.pt2")
    js_path = os.path.join(tmp, f"{name}.ts")
    ex = kwexport.export(f, args, kwargs)
    kwexport.save(ex, kw_path)
    ep = torch.export.export(mod, args, kwargs)
    torch.export.save(ep, te_path)
    try:
        with torch.no_grad():
            traced = (
                torch.jit.trace(mod, args, example_kwarg_inputs=kwargs or None)
                if kwargs
                else torch.jit.trace(mod, args)
            )
        torch.jit.save(traced, js_path)
        has_ts = True
    except Exception:  # TorchScript can't trace keyword-only parameters and nested kwargs
        has_ts = False
    for p in (kw_path, te_path, js_path):
        torch.save((args, kwargs), p + ".inputs")
    row["nodes"] = len(ex._method["graph"]["nodes"])
    row["weight_mb"] = sum(int(t.untyped_storage().nbytes()) for t in ex._weights.values()) / 2**20

    repeats = 1 if quick else 3
    pre = [workloads.PREIMPORT[name]] if name in workloads.PREIMPORT else []
    row["cold_kw"] = cold("kwexport", kw_path, repeats, pre)
    row["cold_te"] = cold("torch.export", te_path, repeats, pre)
    row["cold_ts"] = cold("torchscript", js_path, repeats, pre) if has_ts else None

    # kwexport's loads are cheap: more of them steady the median.
    row["load_kw"] = median_time(lambda: kwexport.load(kw_path), max(n_loads, 40), warmup=5)
    row["load_te"] = median_time(lambda: torch.export.load(te_path).module(), max(3, n_loads // 4), warmup=1)
    row["load_ts"] = median_time(lambda: torch.jit.load(js_path), n_loads, warmup=2) if has_ts else None

    ort_call = onnx_runtime(mod, args, kwargs, os.path.join(tmp, f"{name}.onnx"))
    prog = kwexport.load(kw_path)
    prog_py = kwexport.load(kw_path, dispatch="python")
    row["dispatch"] = prog.dispatch
    gm = torch.export.load(te_path).module()
    ts = torch.jit.load(js_path) if has_ts else None
    with torch.no_grad():
        leaves = prog._flatten(*args, **kwargs)
        row.update(
            interleaved(
                {
                    "call_eager": lambda: f(*args, **kwargs),
                    "call_kw": lambda: prog(*args, **kwargs),
                    "call_kw_py": lambda: prog_py(*args, **kwargs),
                    "floor_kw": lambda: prog._run_flat(leaves),
                    "call_te": lambda: gm(*args, **kwargs),
                    "call_ts": (lambda: ts(*args, **kwargs)) if has_ts else None,
                    "call_ort": ort_call,
                },
                n_calls,
            )
        )
    row["bind_kw"] = median_time(lambda: prog._flatten(*args, **kwargs), n_calls)
    secs = 0.5 if quick else 2.0
    row["thr"] = {
        label: [throughput(lambda fn=fn: fn(*args, **kwargs), k, secs) for k in (1, 2)]
        for label, fn in (("kwexport", prog), ("python", prog_py), ("torch.export", gm))
    }
    row["shared"] = shared_pages(kw_path) if row["weight_mb"] >= 1 else None
    try:
        import optree

        row["optree_flatten"] = median_time(lambda: optree.tree_flatten((args, kwargs)), n_calls)
    except ImportError:
        row["optree_flatten"] = None
    return row


def bench_decode(tmp, quick):
    """Token-by-token greedy decoding with a static KV cache: a Llama built from config,
    exported through transformers' own wrapper. Per-token time in the steady state (every
    runtime decodes its own sequence, taking turns token by token), and a fresh process's
    load plus first token."""
    import transformers
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.cache_implementation = "static"
    n_tokens = 32 if quick else 120
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=n_tokens + 8)
    ep = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    kw_path, te_path = os.path.join(tmp, "decode.kwx"), os.path.join(tmp, "decode.pt2")
    kwexport.save(ep, kw_path)
    torch.export.save(ep, te_path)
    first = ((), {"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([0])})
    for p in (kw_path, te_path):
        torch.save(first, p + ".inputs")
    repeats = 1 if quick else 3
    row = {
        "nodes": kwexport._rt.describe(kw_path)["description"],
        "cold_kw": cold("kwexport", kw_path, repeats),
        "cold_te": cold("torch.export", te_path, repeats),
    }
    row["nodes"] = json.loads(row["nodes"])["methods"]["forward"]["nodes"]
    runtimes = {
        "eager": wrapper.model,
        "kwexport": kwexport.load(kw_path),
        "torch.export": torch.export.load(te_path).module(),
    }
    times = {k: [] for k in runtimes}
    tokens = dict.fromkeys(runtimes, 1)
    with torch.no_grad():
        for pos in range(n_tokens):
            for name, f in runtimes.items():
                ids, cp = torch.tensor([[tokens[name]]]), torch.tensor([pos])
                t = time.perf_counter()
                logits = f(input_ids=ids, cache_position=cp)
                times[name].append(time.perf_counter() - t)
                tokens[name] = int(logits[0, -1].argmax())
    steady = {k: statistics.median(v[8:]) for k, v in times.items()}
    row.update(steady=steady, same_tokens=len(set(tokens.values())) == 1, n_tokens=n_tokens)
    row["dispatch"] = runtimes["kwexport"].dispatch
    return row


def decode_report(r):
    s = r["steady"]
    lines = ["## Generation\n"]
    lines.append(
        "Greedy decoding with a static KV cache: a Llama (2 layers, d=64, vocab 1000) built from config and "
        "exported with transformers' `TorchExportableModuleForDecoderOnlyLM`; `kwexport.save` takes the "
        "ExportedProgram it returns. Per token: the median over tokens 8 to "
        f"{r['n_tokens']} of one call, the three runtimes taking turns token by token, each with its own cache "
        f"({'the same' if r['same_tokens'] else 'different'} tokens came out of all three). Fresh: a new process "
        "after `import torch`, until the first token's logits return.\n"
    )
    lines.append(
        "| nodes on C ABI | per token: eager | torch.export `ep.module()` | kwexport | kwexport / ep.module() | "
        "kwexport / eager | fresh + first token: kwexport | torch.export |"
    )
    lines.append("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    d = r["dispatch"]
    lines.append(
        f"| {d['stable_abi']} of {d['stable_abi'] + d['python']} | {fmt_us(s['eager'])} | {fmt_us(s['torch.export'])} | "
        f"{fmt_us(s['kwexport'])} | {s['kwexport'] / s['torch.export']:.2f} | {s['kwexport'] / s['eager']:.2f} | "
        f"{fmt_ms(r['cold_kw']['cold'])} | {fmt_ms(r['cold_te']['cold'])} |"
    )
    return "\n".join(lines) + "\n"


def fmt_ms(s):
    return "n/a" if s is None else (f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s")


def fmt_us(s):
    return "n/a" if s is None else (f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms")


def ratio(a, b):
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.1f}×"


def report(rows, quick):
    lines = []
    lines.append("# Benchmarks\n")
    lines.append(
        f"Produced by `python benches/compare.py` on {time.strftime('%Y-%m-%d')}"
        f"{' (--quick)' if quick else ''}. Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.processor() or platform.platform()}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"kwexport {kwexport.__version__}; one thread (`torch.set_num_threads(1)`), CPU.\n"
    )
    lines.append("Ratios are torch.export's time over kwexport's (higher is better for kwexport), from the same run.\n")
    lines.append(
        "The workloads after `deep_mlp` are real models no one here wrote, built from config with random weights "
        "and called as their users call them: torchvision's `resnet18` and `mobilenet_v3_small` (1×3×64×64), and "
        "transformers' `gpt2` (`GPT2LMHeadModel`), `bert` (`BertModel`), `llama` (`LlamaForCausalLM`), each 4 layers "
        "of d=128 called as `model(input_ids=..., attention_mask=..., use_cache=False)` on 32 tokens, and `vit` "
        "(`ViTForImageClassification`, 64×64 images), which return `ModelOutput`s. Fresh processes of the "
        "transformers models import `transformers.modeling_outputs` before the clock starts: `torch.export.load` "
        "cannot deserialize a `ModelOutput` whose class isn't registered (kwexport can: it returns a stand-in). "
        "TorchScript can't trace keyword calls.\n"
    )
    lines.append("## Loading\n")
    lines.append(
        "Fresh process: after `import torch`, until the first call returns. Warm: a further load in the same process "
        "(torch.export: `torch.export.load(p).module()`).\n"
    )
    lines.append(
        "| workload | nodes | weights | fresh: kwexport | torch.export | TorchScript | ratio | warm: kwexport | torch.export | TorchScript | ratio |"
    )
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ts_cold = r["cold_ts"]["cold"] if r["cold_ts"] else None
        lines.append(
            f"| {r['workload']} | {r['nodes']} | {r['weight_mb']:.1f} MB | {fmt_ms(r['cold_kw']['cold'])} | {fmt_ms(r['cold_te']['cold'])} "
            f"| {fmt_ms(ts_cold)} | {ratio(r['cold_te']['cold'], r['cold_kw']['cold'])} | {fmt_ms(r['load_kw'])} "
            f"| {fmt_ms(r['load_te'])} | {fmt_ms(r['load_ts'])} | {ratio(r['load_te'], r['load_kw'])} |"
        )
    lines.append("\n## Calling\n")
    lines.append(
        "Call time: the lowest per-round median over five rounds in which the variants take turns. Overhead is the call minus the floor (the same plan run on flat leaves: no binding, "
        "no checks, no pytree work); torch.export's overhead is its call minus the same floor. ONNX Runtime: "
        "`session.run` on numpy inputs prepared once (no conversion or checks per call), one thread, where the "
        "model exports to ONNX (`torch.onnx.export(..., dynamo=True)`).\n"
    )
    lines.append(
        "| workload | nodes on C ABI | eager | kwexport | kwexport, Python ops only | torch.export | TorchScript "
        "| ONNX Runtime | kwexport / eager | kwexport / torch.export | kwexport / TorchScript | kwexport / ONNX Runtime "
        "| kwexport overhead | torch.export overhead | overhead ratio |"
    )
    lines.append(
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for r in rows:
        kw_over = r["call_kw"] - r["floor_kw"]
        te_over = r["call_te"] - r["floor_kw"]
        d = r["dispatch"]
        ts_ratio = "n/a" if r["call_ts"] is None else f"{r['call_kw'] / r['call_ts']:.2f}"
        ort_ratio = "n/a" if r.get("call_ort") is None else f"{r['call_kw'] / r['call_ort']:.2f}"
        lines.append(
            f"| {r['workload']} | {d['stable_abi']} of {d['stable_abi'] + d['python']} | {fmt_us(r['call_eager'])} "
            f"| {fmt_us(r['call_kw'])} | {fmt_us(r['call_kw_py'])} | {fmt_us(r['call_te'])} | {fmt_us(r['call_ts'])} "
            f"| {fmt_us(r.get('call_ort'))} | {r['call_kw'] / r['call_eager']:.2f} | {r['call_kw'] / r['call_te']:.2f} "
            f"| {ts_ratio} | {ort_ratio} "
            f"| {fmt_us(max(kw_over, 0))} | {fmt_us(te_over)} | {ratio(te_over, max(kw_over, 1e-7))} |"
        )
    lines.append("\n## Threads\n")
    lines.append(
        "Calls per second, one thread and two threads calling one Program (or one `ep.module()`) on 2 cores; "
        "scaling is two threads' total over one thread's.\n"
    )
    lines.append(
        "| workload | kwexport: 1 thread | 2 threads | scaling | kwexport, Python ops only: scaling "
        "| torch.export: 1 thread | 2 threads | scaling |"
    )
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        (k1, k2), (p1, p2), (t1, t2) = r["thr"]["kwexport"], r["thr"]["python"], r["thr"]["torch.export"]
        lines.append(
            f"| {r['workload']} | {k1:,.0f}/s | {k2:,.0f}/s | {k2 / k1:.2f}× | {p2 / p1:.2f}× "
            f"| {t1:,.0f}/s | {t2:,.0f}/s | {t2 / t1:.2f}× |"
        )
    lines.append("\n## Binding, flattening and checking\n")
    lines.append(
        "`Program._flatten`: bind to the signature, flatten against the treespec and check every leaf, versus "
        "optree's plain `tree_flatten((args, kwargs))`, which checks nothing.\n"
    )
    lines.append("| workload | kwexport bind + flatten + check | optree.tree_flatten |")
    lines.append("| --- | ---: | ---: |")
    for r in rows:
        lines.append(f"| {r['workload']} | {fmt_us(r['bind_kw'])} | {fmt_us(r['optree_flatten'])} |")
    lines.append("\n## Memory\n")
    lines.append("RSS growth from before loading to after the first call, in a fresh process.\n")
    lines.append("| workload | weights | kwexport | torch.export |")
    lines.append("| --- | ---: | ---: | ---: |")
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['weight_mb']:.1f} MB | {r['cold_kw']['rss'] / 2**20:.1f} MB | {r['cold_te']['rss'] / 2**20:.1f} MB |"
        )
    lines.append(
        "\nFour processes load the same file and call it once; while all four are alive, the file's resident pages "
        "in each process and each one's proportional share (PSS) of them. A PSS of a quarter of the resident "
        "size means the four share one copy, from the page cache.\n"
    )
    lines.append("| workload | weights | file pages resident per process | PSS per process | processes |")
    lines.append("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r["shared"]:
            sh = r["shared"]
            lines.append(
                f"| {r['workload']} | {r['weight_mb']:.1f} MB | {sh['rss_mb']:.1f} MB | {sh['pss_mb']:.1f} MB | {sh['n']} |"
            )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", default=None, help="write the markdown report here")
    parser.add_argument("--only", nargs="*", default=None, help="workload names ('decode' for generation)")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    decode = None
    names = opts.only or [*workloads.NAMES, *workloads.ZOO, "decode"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(f"… {name}", file=sys.stderr, flush=True)
            if name == "decode":
                decode = bench_decode(tmp, opts.quick)
            else:
                rows.append(bench(name, tmp, opts.quick))
    text = report(rows, opts.quick) + ("\n" + decode_report(decode) if decode else "")
    print(text)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
