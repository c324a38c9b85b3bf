"""Optimization levels side by side with the peers: eager, kwexport `exact` and `fast`, ONNX
Runtime (`torch.onnx.export(..., dynamo=True)`, default graph optimizations) and OpenVINO
(`ov.convert_model(exported_program)`, f32) where the bench extra is installed, ExecuTorch
with XNNPACK where `executorch` is installed, and AOTInductor when asked; one thread,
interleaved rounds (best of each), with `fast`'s largest difference from eager relative to
the output's scale, on issue 20's workloads: conv nets at batch 1, transformers of 4 layers
at d=256 on 32 tokens (no cache), and 8 x (Linear 256->256 + GELU) at batch 4. A peer that fails on a model (or computes something else) is a cell
saying so. Writes nothing; prints a Markdown table (BENCHMARKS.md, "Optimization levels").

    python benches/optimize.py [--peers ort,openvino,executorch,aoti]
    python benches/optimize.py --bf16   # precision="bf16" beside OpenVINO's bf16
"""

import tempfile
import timeit
import warnings
from pathlib import Path

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


MODELS = [
    ("torchvision resnet18, 64×64", lambda: torchvision.models.resnet18(num_classes=10), pixels(64)),
    ("torchvision resnet18, 224×224", lambda: torchvision.models.resnet18(num_classes=10), pixels(224)),
    ("torchvision mobilenet_v3_small, 224", lambda: torchvision.models.mobilenet_v3_small(num_classes=10), pixels(224)),
    ("BERT, 4 layers, d=256, 32 tokens", lambda: lm("bert"), lambda: {"input_ids": torch.randint(0, 1000, (1, 32))}),
    ("GPT-2, same size, no cache", lambda: lm("gpt2"), tokens),
    ("Llama, same size, no cache", lambda: lm("llama"), tokens),
    ("8 × (Linear 256→256 + GELU), batch 4", mlp, lambda: {"input": torch.randn(4, 256)}),
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


def ort_session(model, kwargs, tmp: Path):
    """An ONNX Runtime session on one thread (a function of the kwargs), None without the
    bench extra, or the reason its export or session failed."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    try:
        path = tmp / "m.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (), path, kwargs=kwargs, dynamo=True)
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # a peer's failure is a cell of the table
        return peer_failure(e)
    tensors = [v.numpy() for v in kwargs.values() if isinstance(v, torch.Tensor)]
    feed = {i.name: v for i, v in zip(sess.get_inputs(), tensors)}
    return lambda **_kw: sess.run(None, feed)


def openvino_model(model, kwargs, tmp: Path, precision: str = "f32"):
    """OpenVINO from ``ov.convert_model(exported_program)``, compiled for the CPU with one
    inference thread and the f32 precision hint (it would pick bf16 on this CPU; ``--bf16``
    asks for that)."""
    try:
        import openvino as ov
    except ImportError:
        return None
    try:
        # Its CPU plugin can't take a non-tensor input (`use_cache=False`) as a parameter:
        # those are bound into the exported program instead.
        constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        ep = torch.export.export(WithConstants(model, constants), (), tensors)
        compiled = ov.Core().compile_model(
            ov.convert_model(ep),
            "CPU",
            {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"},
        )
        request = compiled.create_infer_request()
        feed = [tensors[i.get_any_name()].numpy() for i in compiled.inputs]
    except Exception as e:
        return peer_failure(e)

    def run(**_kw):
        request.infer(feed)
        return [request.get_output_tensor(0).data]

    return run


def executorch_model(model, kwargs, tmp: Path):
    """ExecuTorch with the XNNPACK delegate (``to_edge_transform_and_lower``), its threadpool
    reset to one thread; ``pip install executorch`` (not in the bench extra: it is large)."""
    try:
        import executorch.extension.pybindings.portable_lib as portable
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime
    except ImportError:
        return None
    try:
        portable._unsafe_reset_threadpool(1)
        ep = torch.export.export(model, (), kwargs)
        program = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
        path = tmp / "m.pte"
        path.write_bytes(program.buffer)
        method = Runtime.get().load_program(path).load_method("forward")
    except Exception as e:
        return peer_failure(e)
    inputs = list(kwargs.values())  # every user input, constants (`use_cache=False`) included
    return lambda **_kw: method.execute(inputs)


def aoti_model(model, kwargs, tmp: Path):
    """AOTInductor (``aoti_compile_and_package``), in torch: compiling takes minutes per model
    on two cores, so it runs only when asked (``--peers ...,aoti``)."""
    try:
        ep = torch.export.export(model, (), kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp / "m.pt2"))
        runner = torch._inductor.aoti_load_package(package)
    except Exception as e:
        return peer_failure(e)
    return runner


PEERS = {
    "ort": ("ONNX Runtime", ort_session),
    "openvino": ("OpenVINO", openvino_model),
    "executorch": ("ExecuTorch + XNNPACK", executorch_model),
    "aoti": ("AOTInductor", aoti_model),
}


def saved(models: list[str] | None, tmp: Path):
    """Each workload whose name contains one of `models` (all without), built with seed 0
    and saved under `tmp`: `(name, model, kwargs, path)`."""
    for name, build, make_inputs in MODELS:
        if models and not any(m in name for m in models):
            continue
        torch.manual_seed(0)
        model, kwargs = build().eval(), make_inputs()
        path = tmp / "m.kwx"
        kwexport.save(kwexport.export(model, (), kwargs), path)
        yield name, model, kwargs, path


def main(peers: list[str], models: list[str] | None = None, rounds: int = 3) -> None:
    torch.set_num_threads(1)
    names = [PEERS[p][0] for p in peers]
    print(
        f"| model | eager | `exact` | `fast` | {' | '.join(names)} | `fast` / `exact` | `fast` / fastest peer | rel. error |"
    )
    print("| --- |" + " ---: |" * (len(names) + 6))
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, kwargs, path in saved(models, Path(tmp)):
            exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
            runners = [("eager", model), ("exact", exact), ("fast", fast)]
            cells = {}
            with torch.no_grad():
                want = first(model(**kwargs))
                err = ((first(fast(**kwargs)) - want).abs().max() / want.abs().max()).item()
                for p in peers:
                    run = PEERS[p][1](model, kwargs, Path(tmp))
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
                best = {}
                for _ in range(rounds):
                    for k, f in runners:
                        t = min(timeit.repeat(lambda f=f, kw=kwargs: f(**kw), number=5, repeat=5)) / 5
                        best[k] = min(best.get(k, float("inf")), t)
            ms = {k: v * 1e3 for k, v in best.items()}
            measured = [ms[p] for p in peers if p in ms]
            fastest = f"{ms['fast'] / min(measured):.2f}" if measured else "–"
            peer_cells = " | ".join(f"{ms[p]:.2f} ms" if p in ms else cells[p] for p in peers)
            print(
                f"| {name} | {ms['eager']:.2f} ms | {ms['exact']:.2f} ms | {ms['fast']:.2f} ms | {peer_cells} "
                f"| {ms['fast'] / ms['exact']:.2f} | {fastest} | {err:.1e} |"
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
        for name, model, kwargs, path in saved(models, Path(tmp)):
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


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="ort,openvino,executorch", help="comma-separated: " + ", ".join(PEERS))
    parser.add_argument("--models", help="comma-separated: only the models whose names contain one of these")
    parser.add_argument("--bf16", action="store_true", help="precision='bf16' beside OpenVINO's bf16 instead")
    args = parser.parse_args()
    models = args.models.split(",") if args.models else None
    if args.bf16:
        main_bf16(models)
    else:
        main(args.peers.split(","), models)
