"""kwexport on a GPU beside eager, ep.module() and torch.compile, in one run (issue 33's table).

    python benches/gpu.py [--models resnet18,bert,gpt2,vit,llama] [--budget SECONDS] [--generate] [--out FILE]
                          [--without PASS,...]

Each model is built from its config (random weights: resnet18 at 224, BERT-base at 128 tokens,
GPT-2 small at 32, as issue 33 measured; ViT-base/16 and the decode benchmark's Llama at 128
tokens, which that table doesn't hold), exported on the CPU and loaded with
`kwexport.load(path, device="cuda", optimize=..., cuda_graphs=...)`. Per model and setup
(batch, dtype) every runtime is timed in interleaved rounds of synchronized calls (best round);
cells are µs per call and × eager. Work is done in order of importance (batch 1 fp32, the Llama
decode, batch 8, batch 1 bf16, torch.compile's default mode) and stops starting new work once
`--budget` seconds have passed, so a leased GPU's time is never overrun; what was measured is
printed as it comes and written to `--out`. `--without` adds a column per pass named: `fast +
graphs` loaded without that pass (`KWEXPORT_SKIP_PASSES`), what the pass is worth in the same run.

AOTInductor is left out: `aoti_load_package` crashed (SIGSEGV) on the device image issue 33
measured on, with or without kwexport imported.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import time

import torch

import kwexport

T0 = time.perf_counter()


def elapsed():
    return time.perf_counter() - T0


def llama_config():
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )


def build(name, batch, dtype):
    """(module, args, kwargs) on the CPU, from config."""
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision

        m = torchvision.models.resnet18().eval().to(dtype)
        return m, (torch.randn(batch, 3, 224, 224, dtype=dtype),), {}
    import transformers

    if name == "bert":  # BERT-base, 128 tokens
        m = transformers.BertModel(transformers.BertConfig(), add_pooling_layer=False).eval().to(dtype)
        ids = torch.randint(0, 30000, (batch, 128))
        return m, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name == "gpt2":  # GPT-2 small, 32 tokens
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval().to(dtype)
        ids = torch.randint(0, 50000, (batch, 32))
        return m, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    if name == "vit":  # ViT-base/16 at 224 (not in issue 33's table: a model of our own)
        m = transformers.ViTModel(transformers.ViTConfig(), add_pooling_layer=False).eval().to(dtype)
        return m, (), {"pixel_values": torch.randn(batch, 3, 224, 224, dtype=dtype)}
    if name == "llama":  # the decode benchmark's Llama, as a 128-token forward without a cache
        m = transformers.LlamaForCausalLM(llama_config()).eval().to(dtype)
        ids = torch.randint(0, 32000, (batch, 128))
        return m, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    raise KeyError(name)


def move(tree, device):
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return torch.utils._pytree.tree_leaves(out)[0]


def interleaved(calls, n=20, rounds=5):
    """Best seconds per call of each callable, timed in interleaved rounds."""
    for f in calls.values():
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    best = {k: float("inf") for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                f()
            torch.cuda.synchronize()
            best[k] = min(best[k], (time.perf_counter() - t) / n)
    return best


def load_without(path, skip, **options):
    """``kwexport.load`` with the passes ``skip`` names left out (``KWEXPORT_SKIP_PASSES``)."""
    before = os.environ.get("KWEXPORT_SKIP_PASSES")
    os.environ["KWEXPORT_SKIP_PASSES"] = skip
    try:
        return kwexport.load(path, **options)
    finally:
        if before is None:
            del os.environ["KWEXPORT_SKIP_PASSES"]
        else:
            os.environ["KWEXPORT_SKIP_PASSES"] = before


def measure(name, batch, dtype, compile_modes, tmp, *, without=()):
    """One row: every runtime on one model and setup; returns {runtime: seconds or error}."""
    from kwexport import _cuda_gemm

    before = set(_cuda_gemm.chosen())
    f, args, kwargs = build(name, batch, dtype)
    with torch.no_grad():
        ex = kwexport.export(f, args, kwargs)
    path = os.path.join(tmp, f"{name}-{batch}-{dtype}.kwx")
    kwexport.save(ex, path)
    dargs, dkwargs = move(args, "cuda"), move(kwargs, "cuda")
    model = f.to("cuda")
    calls = {"eager": lambda: model(*dargs, **dkwargs)}
    try:
        epm = ex.exported_program.module().to("cuda")
        epm(*dargs, **dkwargs)
        calls["ep.module()"] = lambda: epm(*dargs, **dkwargs)
    except Exception as e:  # noqa: BLE001 - torch.export's module can't run some CPU exports on CUDA
        print(f"  {name}: ep.module() fails on cuda: {str(e).splitlines()[0][:100]}", file=sys.stderr)
    for mode in compile_modes:
        c = torch.compile(model, mode=None if mode == "default" else mode)
        with torch.no_grad():
            for _ in range(3):
                c(*dargs, **dkwargs)
        calls[f"compile {mode}"] = lambda c=c: c(*dargs, **dkwargs)
    progs = {}
    for level in ("exact", "fast"):
        for graphs in (False, True):
            label = f"kwexport {level}{' + graphs' if graphs else ''}"
            progs[label] = kwexport.load(path, device="cuda", optimize=level, cuda_graphs=graphs)
    for skip in without:
        progs[f"kwexport fast + graphs - {skip}"] = load_without(
            path, skip, device="cuda", optimize="fast", cuda_graphs=True
        )
    calls.update({label: lambda p=prog: p(*dargs, **dkwargs) for label, prog in progs.items()})
    with torch.no_grad():
        want = first_tensor(model(*dargs, **dkwargs)).float()
        errors = {}
        for label, prog in progs.items():
            for _ in range(3):  # past the warm-up into replays
                got = first_tensor(prog(*dargs, **dkwargs)).float()
            errors[label] = ((got - want).norm() / want.norm()).item()
        plain = first_tensor(progs["kwexport exact"](*dargs, **dkwargs))
        graphed = first_tensor(progs["kwexport exact + graphs"](*dargs, **dkwargs))
        bitwise = torch.equal(plain, graphed)
        times = interleaved(calls)
    why = {label: p.dispatch.get("cuda_graphs", {}).get("why_not") for label, p in progs.items()}
    why = {k: v for k, v in why.items() if v}
    # The GEMMs `fast + graphs` chose on the device (`passes::linear_measured`) in this row.
    choices, micros = _cuda_gemm.chosen(), _cuda_gemm.measured()
    gemms = [
        f"{list(k[0])}x{list(k[1])} {str(k[3])[6:]}{f' + gelu {k[6]}' if k[6] else ''}: {c} ("
        + ", ".join(f"{h} {us:.1f}" for h, us in micros[k].items())
        + " µs)"
        for k, c in choices.items()
        if k not in before
    ]
    if gemms:
        why["gemms"] = "; ".join(gemms)
    del calls, progs
    gc.collect()
    torch.cuda.empty_cache()
    return times, errors, bitwise, why


def llama_decode(budget_left, tokens=64):
    """Per-token time of greedy generation: kwexport's `generate` (with and without CUDA
    graphs) beside transformers' `generate` with a static cache, eager and compiled."""
    import transformers
    from transformers.integrations import executorch

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    model.generation_config.cache_implementation = "static"
    wrapper = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=256)
    ep = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    path = os.path.join(tempfile.mkdtemp(), "llama.kwx")
    kwexport.save(ep, path)
    model = model.cuda()
    prompt = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
    results, seqs = {}, {}

    def run(label, f, reps=3):
        f()  # warm-up (and, for compiled generate, its compilation)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            out = f()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        results[label] = best / tokens
        seqs[label] = out.tolist()

    gen = dict(max_new_tokens=tokens, do_sample=False, max_length=None, cache_implementation="static")
    with torch.no_grad():
        run("transformers eager", lambda: model.generate(prompt, disable_compile=True, **gen))
        for level, graphs in (("exact", False), ("exact", True), ("fast", True)):
            prog = kwexport.load(path, device="cuda", optimize=level, cuda_graphs=graphs)
            label = f"kwexport {level}{' + graphs' if graphs else ''}"
            run(label, lambda p=prog: p.generate(prompt, max_new_tokens=tokens))
        if budget_left() > 200:
            run("transformers compiled", lambda: model.generate(prompt, **gen), reps=2)
    same = {k: v == seqs["transformers eager"] for k, v in seqs.items()}
    return results, same


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,bert,gpt2,vit,llama")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds after which no new work starts")
    parser.add_argument("--generate", action="store_true", help="time the Llama decode")
    parser.add_argument("--compile", default="reduce-overhead,default", help="torch.compile's modes, or none")
    parser.add_argument("--batches", default="1,8", help="batch sizes (8: float32 only)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--without", default="", help="passes, each timed as a column of fast + graphs without it")
    opts = parser.parse_args()
    models = [m for m in opts.models.split(",") if m]
    left = lambda: opts.budget - elapsed()  # noqa: E731
    tmp = tempfile.mkdtemp()
    dev = torch.cuda.get_device_name()
    lines = [
        f"Device: {dev}; torch {torch.__version__}; Python {platform.python_version()}; "
        f"stable C ABI: {kwexport._rt.stable_abi_available()}; best of 5 interleaved rounds of 20 synchronized calls.",
        "",
    ]

    def emit(line):
        lines.append(line)
        print(line, flush=True)
        if opts.out:
            with open(opts.out, "w") as fh:
                fh.write("\n".join(lines) + "\n")

    modes = [m for m in opts.compile.split(",") if m != "none"]
    overhead = [m for m in modes if m == "reduce-overhead"]
    plan = [(m, 1, torch.float32, overhead) for m in models]
    plan += [("generate",)] if opts.generate else []
    plan += [(m, 8, torch.float32, []) for m in models] if "8" in opts.batches.split(",") else []
    plan += [(m, 1, torch.bfloat16, overhead) for m in models]
    plan += [(m, 1, torch.float32, ["default"]) for m in models[:3]] if "default" in modes else []
    header = False
    without = [p for p in opts.without.split(",") if p]
    for item in plan:
        if left() < 60:
            emit(f"(budget spent at {elapsed():.0f} s: skipped {item[:3]})")
            continue
        if item[0] == "generate":
            try:
                results, same = llama_decode(left)
            except Exception as e:  # noqa: BLE001
                emit(f"Llama decode failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            emit("")
            emit(
                "Llama (8 layers, d=1024, GQA 16/4, static cache 256), 16-token prompt, 64 greedy tokens, µs per token:"
            )
            emit("")
            for k, v in results.items():
                emit(f"- {k}: {v * 1e6:.0f} µs (same tokens as transformers eager: {same[k]})")
            emit("")
            header = False
            continue
        name, batch, dtype, modes = item
        try:
            times, errors, bitwise, why = measure(name, batch, dtype, modes, tmp, without=without)
        except Exception as e:  # noqa: BLE001
            emit(f"{name} batch {batch} {dtype}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        if not header:
            emit("| model | batch | dtype | runtime | µs per call | × eager | rel. error vs eager |")
            emit("| --- | ---: | --- | --- | ---: | ---: | ---: |")
            header = True
        e = times["eager"]
        for k, t in times.items():
            err = f"{errors[k]:.1e}" if k in errors else ""
            emit(f"| {name} | {batch} | {str(dtype)[6:]} | {k} | {t * 1e6:.0f} | {t / e:.2f} | {err} |")
        emit(f"|  |  |  | graphs replay = plain bitwise: {bitwise} {why or ''} |  |  |  |")
    emit(f"(done in {elapsed():.0f} s)")


if __name__ == "__main__":
    main()
