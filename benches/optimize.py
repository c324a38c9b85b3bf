"""Optimization levels side by side: eager, kwexport `exact` and `fast`, and ONNX Runtime where
the bench extra is installed (`torch.onnx.export(..., dynamo=True)`, default graph
optimizations, one thread), one thread, interleaved rounds (best of each), with `fast`'s
largest difference from eager relative to the output's scale, on issue 20's workloads: conv
nets at batch 1, transformers of 4 layers at d=256 on 32 tokens (no cache), and 8 x (Linear
256->256 + GELU) at batch 4. A peer that fails on a model is a cell saying so. Writes
nothing; prints a Markdown table (BENCHMARKS.md, "Optimization levels").

    python benches/optimize.py
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
    """The first tensor of a model's output (a tensor, or a ModelOutput's first field)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def ort_session(model, kwargs, path: Path):
    """An ONNX Runtime session on one thread (a function of the kwargs), None without the
    bench extra, or the reason its export or session failed."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (), path, kwargs=kwargs, dynamo=True)
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # a peer's failure is a cell of the table
        return f"fails: {type(e).__name__}"
    tensors = [v.numpy() for v in kwargs.values() if isinstance(v, torch.Tensor)]
    feed = {i.name: v for i, v in zip(sess.get_inputs(), tensors)}
    return lambda **_kw: sess.run(None, feed)


def main(rounds: int = 3) -> None:
    torch.set_num_threads(1)
    print(
        "| model | eager | `exact` | `fast` | ONNX Runtime | `fast` / eager | `fast` / `exact` | `fast` / ORT | rel. error |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, build, make_inputs in MODELS:
            torch.manual_seed(0)
            model, kwargs = build().eval(), make_inputs()
            path = Path(tmp) / "m.kwx"
            kwexport.save(kwexport.export(model, (), kwargs), path)
            exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
            ort = ort_session(model, kwargs, Path(tmp) / "m.onnx")
            runners = [("eager", model), ("exact", exact), ("fast", fast)] + ([("ort", ort)] if callable(ort) else [])
            with torch.no_grad():
                want = first(model(**kwargs))
                err = ((first(fast(**kwargs)) - want).abs().max() / want.abs().max()).item()
                best = {}
                for _ in range(rounds):
                    for k, f in runners:
                        t = min(timeit.repeat(lambda f=f, kw=kwargs: f(**kw), number=5, repeat=5)) / 5
                        best[k] = min(best.get(k, float("inf")), t)
            e, x_, f = best["eager"] * 1e3, best["exact"] * 1e3, best["fast"] * 1e3
            if "ort" in best:
                o = best["ort"] * 1e3
                ort_cells = f"{o:.2f} ms", f"{f / o:.2f}"
            else:
                ort_cells = (ort or "not installed"), "–"
            print(
                f"| {name} | {e:.2f} ms | {x_:.2f} ms | {f:.2f} ms | {ort_cells[0]} | {f / e:.2f} | {f / x_:.2f} "
                f"| {ort_cells[1]} | {err:.1e} |"
            )


if __name__ == "__main__":
    main()
