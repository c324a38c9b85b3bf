"""Optimization levels side by side with the peers: eager, kwexport `exact` and `fast`, ONNX
Runtime (`torch.onnx.export(..., dynamo=True)`, default graph optimizations) and OpenVINO
(`ov.convert_model(exported_program)`, f32) where the bench extra is installed, ExecuTorch
with XNNPACK where `executorch` is installed, and AOTInductor when asked; each at the same
intra-op thread count, interleaved rounds (best of each), with `fast`'s largest difference
from eager relative to the output's scale. A peer that fails on a model (or computes
something else) is a cell saying so. Writes nothing; prints a Markdown table (BENCHMARKS.md).

The models: issue 20's workloads, which `fast`'s kernels were tuned on (the `tuned` set: conv
nets at batch 1, transformers of 4 layers at d=256 on 32 tokens without a cache, 8 x (Linear
256->256 + GELU) at batch 4), and with `--zoo` the `holdout` set, which no choice was tuned
on: torchvision, timm and transformers models at other sizes (encoders and decoders at 128
and 512 tokens, vision transformers, conv nets with grouped, depthwise and 7x7 kernels).

    python benches/optimize.py [--peers ort,openvino,executorch,aoti] [--threads 1,2] [--zoo]
    python benches/optimize.py --isa avx2   # kwexport's AVX2 kernels, torch and OpenVINO's
                                            # convolutions limited to AVX2 (ONNX Runtime and
                                            # OpenVINO's FullyConnected can't be)
    python benches/optimize.py --bf16   # precision="bf16" beside OpenVINO's bf16
    python benches/optimize.py --int8   # kwexport.quantize's programs beside ONNX Runtime's
                                        # quantize_dynamic (needs torchao and onnxruntime)
"""

import os
import re
import sys
import tempfile
import time
import timeit
import warnings
from pathlib import Path

# `--isa NAME` runs the whole table with kwexport's kernels of that family and, where the
# peers can be limited, theirs: set before torch (oneDNN, MKL) and OpenVINO load. OpenVINO
# honours ONEDNN_MAX_CPU_ISA in its convolutions (brgconv_avx2_f32) but not in its
# FullyConnected, which runs at AVX-512's rate regardless (a 256x1024 chain at 32 rows: 220
# GFLOP/s with the limit, where one Zen 5 core's 8-lane FMAs peak near 125): its linears,
# like all of ONNX Runtime, are not an AVX2 server's.
if "--isa" in sys.argv[:-1]:
    _isa = sys.argv[sys.argv.index("--isa") + 1]
    os.environ["KWEXPORT_ISA"] = _isa
    if _isa == "avx2":
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
        os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"

import torch
import torchvision
import transformers

import kwexport


def pixels(size):
    return lambda: {"x": torch.randn(1, 3, size, size)}


def tokens():
    return {"input_ids": torch.randint(0, 1000, (1, 32)), "use_cache": False}


def lm(kind):
    common = dict(vocab_size=1000, num_hidden_layers=4, num_attention_heads=4)
    if kind == "bert":
        cfg = transformers.BertConfig(hidden_size=256, intermediate_size=1024, **common)
        return transformers.BertModel(cfg)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=1000, n_embd=256, n_layer=4, n_head=4))
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=1024, num_key_value_heads=4, **common)
    return transformers.LlamaForCausalLM(cfg)


def mlp():
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(8)]
    return torch.nn.Sequential(*layers)


def encoder(d, layers, heads):
    cfg = transformers.BertConfig(
        vocab_size=1000, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * d
    )
    return transformers.BertModel(cfg)


def ids(n):
    return lambda: {"input_ids": torch.randint(0, 1000, (1, n))}


def decoder_tokens(n):
    return lambda: {"input_ids": torch.randint(0, 1000, (1, n)), "use_cache": False}


def vit():
    cfg = transformers.ViTConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536, image_size=224
    )
    return transformers.ViTModel(cfg, add_pooling_layer=False)


def tv(name, **kw):
    return lambda: getattr(torchvision.models, name)(num_classes=10, **kw)


def timm_model(name):
    def build():
        import timm  # the bench extra

        return timm.create_model(name, pretrained=False, num_classes=10)

    return build


# Issue 20's workloads: the set `fast`'s kernels and thresholds were tuned on.
MODELS = [
    ("torchvision resnet18, 64×64", tv("resnet18"), pixels(64)),
    ("torchvision resnet18, 224×224", tv("resnet18"), pixels(224)),
    ("torchvision mobilenet_v3_small, 224", tv("mobilenet_v3_small"), pixels(224)),
    ("BERT, 4 layers, d=256, 32 tokens", lambda: lm("bert"), ids(32)),
    ("GPT-2, same size, no cache", lambda: lm("gpt2"), tokens),
    ("Llama, same size, no cache", lambda: lm("llama"), tokens),
    ("8 × (Linear 256→256 + GELU), batch 4", mlp, lambda: {"input": torch.randn(4, 256)}),
]

# Models no choice was tuned on (`--zoo`): how `fast` does on what users bring.
HOLDOUT = [
    ("torchvision mobilenet_v2, 224", tv("mobilenet_v2"), pixels(224)),
    ("torchvision shufflenet_v2_x1_0, 224", tv("shufflenet_v2_x1_0"), pixels(224)),
    ("torchvision efficientnet_b0, 224", tv("efficientnet_b0"), pixels(224)),
    ("torchvision regnet_y_400mf, 224", tv("regnet_y_400mf"), pixels(224)),
    ("torchvision squeezenet1_1, 224", tv("squeezenet1_1"), pixels(224)),
    ("torchvision resnet50, 128×128", tv("resnet50"), pixels(128)),
    ("timm convnext_atto, 224", timm_model("convnext_atto"), pixels(224)),
    ("timm ghostnet_100, 224", timm_model("ghostnet_100"), pixels(224)),
    ("timm vit_tiny_patch16_224", timm_model("vit_tiny_patch16_224"), pixels(224)),
    ("timm regnetx_002, 224", timm_model("regnetx_002"), pixels(224)),
    ("BERT, 6 layers, d=384, 128 tokens", lambda: encoder(384, 6, 12), ids(128)),
    ("BERT, 4 layers, d=768, 128 tokens", lambda: encoder(768, 4, 12), ids(128)),
    ("BERT, 4 layers, d=256, 512 tokens", lambda: lm("bert"), ids(512)),
    ("GPT-2, 4 layers, d=256, 128 tokens", lambda: lm("gpt2"), decoder_tokens(128)),
    ("Llama, 4 layers, d=256, 512 tokens", lambda: lm("llama"), decoder_tokens(512)),
    ("ViT, 6 layers, d=384, 224 px", vit, lambda: {"pixel_values": torch.randn(1, 3, 224, 224)}),
]


def first(out):
    """The first tensor of a model's output (a tensor, a ModelOutput's first field, or a
    peer's first array)."""
    if isinstance(out, torch.Tensor):
        return out
    return torch.as_tensor(out[0]) if isinstance(out, (list, tuple)) else out[0]


class WithConstants(torch.nn.Module):
    """A model called with some keyword arguments fixed."""

    def __init__(self, model, constants):
        super().__init__()
        self.model, self.constants = model, constants

    def forward(self, **tensors):
        return self.model(**tensors, **self.constants)


def peer_failure(e: Exception) -> str:
    """A peer's failure as a table cell."""
    return f"fails: {type(e).__name__}"


def ort_session(model, kwargs, tmp: Path, threads: int = 1):
    """An ONNX Runtime session on `threads` intra-op threads (a function of the kwargs), None
    without the bench extra, or the reason its export or session failed. The model is
    exported once per `tmp` folder (`saved` empties it per model)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    try:
        path = tmp / "m.onnx"
        if not path.exists():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(model, (), path, kwargs=kwargs, dynamo=True)
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # a peer's failure is a cell of the table
        return peer_failure(e)
    return ort_runner(sess, kwargs)


def ort_runner(sess, kwargs):
    """An ONNX Runtime session's runner: `run()` on the bench's inputs, bound once (what is
    timed: no conversion per call), or `run(inputs=kw)` on others (int8's top-1 agreement)."""

    def feed_of(kw):
        tensors = [v.numpy() for v in kw.values() if isinstance(v, torch.Tensor)]
        return {i.name: v for i, v in zip(sess.get_inputs(), tensors)}

    feed = feed_of(kwargs)
    return lambda inputs=None, **_kw: sess.run(None, feed if inputs is None else feed_of(inputs))


def openvino_model(model, kwargs, tmp: Path, precision: str = "f32", threads: int = 1, *, int8: bool = False):
    """OpenVINO from ``ov.convert_model(exported_program)``, compiled for the CPU with
    `threads` inference threads and the f32 precision hint (it would pick bf16 on a CPU with
    AVX512-BF16; ``--bf16`` asks for that). With `int8`, NNCF's post-training quantization
    of that model first (``nncf.quantize``, its default preset: int8 weights and activations,
    calibrated on the bench's input, as ``kwexport.quantize`` is; ``model_type=TRANSFORMER``,
    as NNCF advises, for a model with attention modules)."""
    try:
        import openvino as ov

        if int8:
            import nncf
    except ImportError:
        return None
    try:
        # Its CPU plugin can't take a non-tensor input (`use_cache=False`) as a parameter:
        # those are bound into the exported program instead.
        constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        ep = torch.export.export(WithConstants(model, constants), (), tensors)
        converted = ov.convert_model(ep)
        if int8:
            sample = {i.get_any_name(): tensors[i.get_any_name()].numpy() for i in converted.inputs}
            attention = any("Attention" in type(m).__name__ for m in model.modules())
            kind = {"model_type": nncf.ModelType.TRANSFORMER} if attention else {}
            converted = nncf.quantize(converted, nncf.Dataset([sample]), subset_size=1, **kind)
        compiled = ov.Core().compile_model(
            converted,
            "CPU",
            {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"},
        )
        request = compiled.create_infer_request()
        feed = [tensors[i.get_any_name()].numpy() for i in compiled.inputs]
    except Exception as e:
        return peer_failure(e)

    def run(inputs=None, **_kw):  # as `ort_runner`'s
        request.infer(feed if inputs is None else [inputs[i.get_any_name()].numpy() for i in compiled.inputs])
        return [request.get_output_tensor(0).data]

    return run


def executorch_model(model, kwargs, tmp: Path, threads: int = 1):
    """ExecuTorch with the XNNPACK delegate (``to_edge_transform_and_lower``), its threadpool
    reset to `threads`; ``pip install executorch`` (not in the bench extra: it is large)."""
    try:
        import executorch.extension.pybindings.portable_lib as portable
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime
    except ImportError:
        return None
    try:
        portable._unsafe_reset_threadpool(threads)
        ep = torch.export.export(model, (), kwargs)
        program = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
        path = tmp / "m.pte"
        path.write_bytes(program.buffer)
        method = Runtime.get().load_program(path).load_method("forward")
    except Exception as e:
        return peer_failure(e)
    inputs = list(kwargs.values())  # every user input, constants (`use_cache=False`) included
    return lambda **_kw: method.execute(inputs)


def aoti_model(model, kwargs, tmp: Path, threads: int = 1):
    """AOTInductor (``aoti_compile_and_package``), in torch (its kernels use torch's threads):
    compiling takes minutes per model on two cores, so it runs only when asked (``--peers
    ...,aoti``)."""
    try:
        path = tmp / "m.pt2"
        if not path.exists():
            ep = torch.export.export(model, (), kwargs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
        runner = torch._inductor.aoti_load_package(str(path))
    except Exception as e:
        return peer_failure(e)
    return runner


PEERS = {
    "ort": ("ONNX Runtime", ort_session),
    "openvino": ("OpenVINO", openvino_model),
    "executorch": ("ExecuTorch + XNNPACK", executorch_model),
    "aoti": ("AOTInductor", aoti_model),
}


def settled(model: torch.nn.Module, make_inputs) -> torch.nn.Module:
    """`model` in eval mode, its BatchNorm statistics (if it has any) measured on 8 random
    inputs as a trained model's are on its data. At initialization (mean 0, variance 1) a
    deep conv net's activations shrink layer by layer (torchvision's mobilenet_v2 returns
    logits of 1e-9), which no trained model does: int8's scales and every error column
    would measure nothing."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms:
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the passes below
        model.train()
        with torch.no_grad():
            for _ in range(8):
                model(**make_inputs())
    return model.eval()


def saved(models: list[str] | None, tmp: Path, zoo: bool = False):
    """Each workload whose name contains one of `models` (all without; the holdout set too
    with `zoo`), built with seed 0 and saved under a folder of its own in `tmp`: `(name, set,
    model, kwargs, path)`, or `(name, set, None, error, None)` where it can't be exported."""
    sets = [("tuned", MODELS)] + ([("holdout", HOLDOUT)] if zoo else [])
    for i, (which, (name, build, make_inputs)) in enumerate((w, m) for w, ms in sets for m in ms):
        if models and not any(m in name for m in models):
            continue
        folder = tmp / str(i)
        folder.mkdir()
        torch.manual_seed(0)
        try:
            model = settled(build(), make_inputs)
            kwargs = make_inputs()
            path = folder / "m.kwx"
            kwexport.save(kwexport.export(model, (), kwargs), path)
        except Exception as e:
            yield name, which, None, f"{type(e).__name__}: {str(e)[:80]}", None
            continue
        yield name, which, model, kwargs, path


# How long the other runtimes' worker threads get to stop spinning before a runner is timed.
SETTLE_S = 0.3


# Calls each runner makes at a thread count before it is timed: kwexport's first ten calls
# with a shape run its candidate kernels in turn (`plan::TRIAL_RUNS`).
WARMUP_CALLS = 12


def warm_up(runners, kwargs) -> None:
    """Calls each runner (the callable ones) past `fast`'s kernel trials."""
    for f in runners:
        if callable(f):
            for _ in range(WARMUP_CALLS):
                f(**kwargs)


def best_time(f, kwargs) -> float:
    """Seconds per call: the best of 5 repeats of enough calls to take ~20 ms, after a pause
    and three calls. Without the pause the runtimes measured each other's thread pools: at
    two threads on two cores, ONNX Runtime's workers still spinning after its calls made
    kwexport's squeezenet1_1 take 1.9–4.0 ms a call where it takes 1.4 alone, and torch's
    OpenMP team made ONNX Runtime's 1.5 where it takes 1.2 (each runtime in a serving worker
    runs alone)."""
    time.sleep(SETTLE_S)
    for _ in range(3):
        f(**kwargs)
    once = timeit.timeit(lambda: f(**kwargs), number=1)
    number = max(1, min(20, int(0.02 / max(once, 1e-6))))
    return min(timeit.repeat(lambda: f(**kwargs), number=number, repeat=5)) / number


def main(peers: list[str], models: list[str] | None, threads: list[int], zoo: bool, rounds: int = 3) -> None:
    names = [PEERS[p][0] for p in peers]
    info = kwexport.kernel_info()
    print(f"kwexport kernels: {info['isa']} (of {', '.join(info['supported'])}); torch {torch.__version__}")
    print(
        f"| model | set | threads | eager | `exact` | `fast` | {' | '.join(names)} "
        "| `fast` / `exact` | `fast` / fastest peer | rel. error |"
    )
    print("| --- | --- |" + " ---: |" * (len(names) + 7))
    with tempfile.TemporaryDirectory() as tmp:
        for name, which, model, kwargs, path in saved(models, Path(tmp), zoo):
            if model is None:
                print(f"| {name} | {which} | – | kwexport can't export it: {kwargs} |")
                continue
            exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
            with torch.no_grad():
                want = first(model(**kwargs))
                err = ((first(fast(**kwargs)) - want).abs().max() / want.abs().max()).item()
            for n in threads:
                torch.set_num_threads(n)
                runners = [("eager", model), ("exact", exact), ("fast", fast)]
                cells = {}
                with torch.no_grad():
                    for p in peers:
                        run = PEERS[p][1](model, kwargs, path.parent, threads=n)
                        if callable(run):
                            # A peer is compared only where it computes what eager does.
                            try:
                                got = first(run(**kwargs))
                                if ((got - want).abs().max() / want.abs().max()).item() > 1e-4:
                                    run = "fails: a different result"
                            except Exception as e:
                                run = peer_failure(e)
                        if callable(run):
                            runners.append((p, run))
                        else:
                            cells[p] = run or "not installed"
                    warm_up([f for _, f in runners], kwargs)
                    best = {}
                    for _ in range(rounds):
                        for k, f in runners:
                            best[k] = min(best.get(k, float("inf")), best_time(f, kwargs))
                ms = {k: v * 1e3 for k, v in best.items()}
                measured = [ms[p] for p in peers if p in ms]
                fastest = f"{ms['fast'] / min(measured):.2f}" if measured else "–"
                peer_cells = " | ".join(f"{ms[p]:.2f} ms" if p in ms else cells[p] for p in peers)
                print(
                    f"| {name} | {which} | {n} | {ms['eager']:.2f} ms | {ms['exact']:.2f} ms | {ms['fast']:.2f} ms "
                    f"| {peer_cells} | {ms['fast'] / ms['exact']:.2f} | {fastest} | {err:.1e} |",
                    flush=True,
                )


def main_bf16(models: list[str] | None = None, rounds: int = 3) -> None:
    """``precision="bf16"`` beside ``fast`` and OpenVINO at each precision hint, with each
    bfloat16 result's largest difference from eager relative to its scale."""
    torch.set_num_threads(1)
    print(
        "| model | `fast` | `bf16` | OpenVINO f32 | OpenVINO bf16 | `bf16` / `fast` "
        "| `bf16` / OpenVINO bf16 | `bf16` rel. error | OpenVINO bf16 rel. error |"
    )
    print("| --- |" + " ---: |" * 8)
    with tempfile.TemporaryDirectory() as tmp:
        for name, _, model, kwargs, path in saved(models, Path(tmp)):
            if model is None:
                continue
            runners = {
                "fast": kwexport.load(path, optimize="fast"),
                "bf16": kwexport.load(path, precision="bf16"),
                "ov": openvino_model(model, kwargs, Path(tmp)),
                "ov_bf16": openvino_model(model, kwargs, Path(tmp), "bf16"),
            }
            with torch.no_grad():
                want = first(model(**kwargs))
                errs = {}
                for k in ("bf16", "ov_bf16"):
                    if callable(runners[k]):
                        got = torch.as_tensor(first(runners[k](**kwargs)))
                        errs[k] = ((got - want).abs().max() / want.abs().max()).item()
                warm_up(runners.values(), kwargs)
                best = {}
                for _ in range(rounds):
                    for k, f in runners.items():
                        if callable(f):
                            t = min(timeit.repeat(lambda f=f, kw=kwargs: f(**kw), number=5, repeat=5)) / 5
                            best[k] = min(best.get(k, float("inf")), t)
            ms = {k: v * 1e3 for k, v in best.items()}
            cells = [f"{ms[k]:.2f} ms" if k in ms else (runners[k] or "not installed") for k in runners]
            cells += [
                f"{ms[a] / ms[b]:.2f}" if a in ms and b in ms else "–"
                for a, b in [("bf16", "fast"), ("bf16", "ov_bf16")]
            ]
            cells += [f"{errs[k]:.1e}" if k in errs else "–" for k in ("bf16", "ov_bf16")]
            print(f"| {name} | {' | '.join(cells)} |")


def openvino_int8_model(model, kwargs, tmp: Path, threads: int = 1):
    """OpenVINO's int8 (NNCF): ``openvino_model`` with ``int8``."""
    return openvino_model(model, kwargs, tmp, threads=threads, int8=True)


def ort_int8_session(model, kwargs, tmp: Path, threads: int = 1, static: bool = False):
    """ONNX Runtime on its int8 model from the same export as ``ort_session``'s:
    ``quantize_dynamic`` (int8 weights, activations quantized per call), or with `static`
    ``quantize_static`` (QDQ, per-channel int8 weights, uint8 activations calibrated on the
    bench's input, as ``kwexport.quantize`` is)."""
    try:
        import onnxruntime as ort
        from onnxruntime import quantization as oq
    except ImportError:
        return None
    if isinstance(fp32 := ort_session(model, kwargs, tmp, threads), str):
        return fp32
    tensors = [v.numpy() for v in kwargs.values() if isinstance(v, torch.Tensor)]
    out = tmp / ("m.int8s.onnx" if static else "m.int8.onnx")
    try:
        if static:
            names = [i.name for i in ort.InferenceSession(str(tmp / "m.onnx")).get_inputs()]

            class Once(oq.CalibrationDataReader):
                def __init__(self):
                    self.left = [dict(zip(names, tensors))]

                def get_next(self):
                    return self.left.pop() if self.left else None

            oq.quantize_static(str(tmp / "m.onnx"), str(out), Once(), per_channel=True, weight_type=oq.QuantType.QInt8)
        else:
            oq.quantize_dynamic(str(tmp / "m.onnx"), str(out), weight_type=oq.QuantType.QInt8)
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        sess = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        return peer_failure(e)
    return ort_runner(sess, kwargs)


def ort_int8_static_session(model, kwargs, tmp: Path, threads: int = 1):
    """``ort_int8_session`` with ``static``."""
    return ort_int8_session(model, kwargs, tmp, threads, static=True)


# Kept apart from the inputs int8 is calibrated on (the bench's own).
AGREEMENT_INPUTS = 32


def top1_agreement(model, runners: dict, kwargs) -> dict[str, str]:
    """For a classifier: the share of `AGREEMENT_INPUTS` random inputs (shaped as `kwargs`,
    none of them the calibration input) on which each runner's top class is float32 eager's.
    kwexport's programs take the inputs as the model does, the peers as `inputs=`."""
    g = torch.Generator().manual_seed(1)
    hits = dict.fromkeys(runners, 0)
    for _ in range(AGREEMENT_INPUTS):
        kw = {k: torch.randn(v.shape, generator=g) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        want = first(model(**kw)).argmax()
        for label, f in runners.items():
            got = f(**kw) if isinstance(f, kwexport.Program) else f(inputs=kw)
            hits[label] += int(first(got).argmax() == want)
    return {label: f"{h}/{AGREEMENT_INPUTS}" for label, h in hits.items()}


def main_int8(
    models: list[str] | None, threads: list[int], zoo: bool, rounds: int = 3, reduce_range: bool = False
) -> None:
    """int8 beside float32: kwexport's programs from ``kwexport.quantize`` (pt2e's x86 flow,
    static and dynamic, at ``fast``; with `reduce_range`, activations of 128 levels), ONNX
    Runtime's ``quantize_dynamic``, and the float32 model at ``fast``; each int8 row's largest
    difference from float32 eager relative to the output's scale."""
    print(f"kwexport kernels: {kwexport.kernel_info()}; torch {torch.__version__}")
    reduced = ", reduce_range" if reduce_range else ""
    static, dynamic = f"int8 static `fast`{reduced}", f"int8 dynamic `fast`{reduced}"
    cols = [
        "eager f32",
        "`fast` f32",
        static,
        dynamic,
        "ORT f32",
        "ORT int8 dynamic",
        "ORT int8 static",
        "OpenVINO int8",
    ]
    int8_labels = cols[2:4] + cols[5:]
    print(f"| model | threads | {' | '.join(cols)} | errors: {', '.join(int8_labels)} | top-1 agreement |")
    print("| --- | ---: |" + " ---: |" * (len(cols) + 2))
    with tempfile.TemporaryDirectory() as tmp:
        for name, _which, model, kwargs, path in saved(models, Path(tmp), zoo):
            if model is None:
                print(f"| {name} | – | kwexport can't export it: {kwargs} |")
                continue
            runners, cells, errors, agree = {"eager f32": model}, {}, {}, {}
            with torch.no_grad():
                want = first(model(**kwargs))
            runners["`fast` f32"] = kwexport.load(path, optimize="fast")
            for label, activations in [(static, "static"), (dynamic, "dynamic")]:
                try:
                    q = path.parent / f"{activations}.kwx"
                    ex = kwexport.quantize(model, (), kwargs, activations=activations, reduce_range=reduce_range)
                    kwexport.save(ex, q)
                    runners[label] = kwexport.load(q, optimize="fast")
                except Exception as e:
                    cells[label] = peer_failure(e)
            for n in threads:
                torch.set_num_threads(n)
                live = dict(runners)
                peers = [
                    ("ORT f32", ort_session),
                    ("ORT int8 dynamic", ort_int8_session),
                    ("ORT int8 static", ort_int8_static_session),
                    ("OpenVINO int8", openvino_int8_model),
                ]
                for label, make in peers:
                    run = make(model, kwargs, path.parent, threads=n)
                    if callable(run):
                        live[label] = run
                    else:
                        cells[label] = run or "not installed"
                with torch.no_grad():
                    for label in int8_labels:
                        if label in live:
                            got = first(live[label](**kwargs))
                            errors[label] = f"{((got - want).abs().max() / want.abs().max()).item():.1e}"
                    if n == threads[0] and name.startswith(("torchvision", "timm")) and want.shape == (1, 10):
                        agree.update(top1_agreement(model, {k: live[k] for k in int8_labels if k in live}, kwargs))
                    warm_up(live.values(), kwargs)
                    best: dict[str, float] = {}
                    for _ in range(rounds):
                        for label, f in live.items():
                            best[label] = min(best.get(label, float("inf")), best_time(f, kwargs))
                row = " | ".join(f"{best[c] * 1e3:.2f} ms" if c in best else cells.get(c, "–") for c in cols)
                errs = ", ".join(errors.get(c, "–") for c in int8_labels)
                top1 = ", ".join(agree.get(c, "–") for c in int8_labels)
                print(f"| {name} | {n} | {row} | {errs} | {top1} |", flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--peers", default="ort,openvino,executorch", help="comma-separated: " + ", ".join(PEERS) + "; or none"
    )
    parser.add_argument(
        "--models",
        help="comma-separated: only the models whose names contain one of these "
        "(a comma followed by a space stays in the name: 'resnet18, 224')",
    )
    parser.add_argument("--bf16", action="store_true", help="precision='bf16' beside OpenVINO's bf16 instead")
    parser.add_argument("--int8", action="store_true", help="kwexport.quantize's int8 beside ONNX Runtime's instead")
    parser.add_argument("--reduce-range", action="store_true", help="with --int8: kwexport's activations of 128 levels")
    parser.add_argument("--threads", default="1", help="comma-separated intra-op thread counts, e.g. 1,2")
    parser.add_argument("--zoo", action="store_true", help="the holdout models too, beside the tuned set")
    parser.add_argument("--isa", help="avx512, avx2 or portable: kwexport's kernels of that family (read at start)")
    args = parser.parse_args()
    # Names hold ", " ("torchvision resnet18, 224×224"): only a comma without a space splits.
    models = re.split(r",(?! )", args.models) if args.models else None
    if args.bf16:
        main_bf16(models)
    elif args.int8:
        main_int8(models, [int(t) for t in args.threads.split(",")], args.zoo, reduce_range=args.reduce_range)
    else:
        peers = [p for p in args.peers.split(",") if p not in ("", "none")]
        main(peers, models, [int(t) for t in args.threads.split(",")], args.zoo)
