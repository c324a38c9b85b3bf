"""Optimization levels side by side: eager, kwexport `exact` and `fast`, and ONNX Runtime where
the bench extra is installed (`torch.onnx.export(..., dynamo=True)`, default graph
optimizations, one thread), one thread, batch 1, interleaved rounds (best of each), with
`fast`'s largest difference from eager relative to the output's scale. Writes nothing;
prints a Markdown table (BENCHMARKS.md, "Optimization levels").

    python benches/optimize.py
"""

import tempfile
import timeit
import warnings
from pathlib import Path

import torch
import torchvision

import kwexport

MODELS = [
    ("torchvision resnet18, 64×64", lambda: torchvision.models.resnet18(num_classes=10), (1, 3, 64, 64)),
    ("torchvision resnet18, 224×224", lambda: torchvision.models.resnet18(num_classes=10), (1, 3, 224, 224)),
    (
        "torchvision mobilenet_v3_small, 224×224",
        lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
        (1, 3, 224, 224),
    ),
]


def ort_session(model, x, path: Path):
    """An ONNX Runtime session on one thread, or None without the bench extra."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), path, dynamo=True)
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    name, xn = sess.get_inputs()[0].name, x.numpy()
    return lambda _x: sess.run(None, {name: xn})


def main(rounds: int = 3) -> None:
    torch.set_num_threads(1)
    print(
        "| model | eager | `exact` | `fast` | ONNX Runtime | `fast` / eager | `fast` / `exact` | `fast` / ORT | rel. error |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, build, shape in MODELS:
            torch.manual_seed(0)
            model, x = build().eval(), torch.randn(shape)
            path = Path(tmp) / "m.kwx"
            kwexport.save(kwexport.export(model, (x,)), path)
            exact, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
            ort = ort_session(model, x, Path(tmp) / "m.onnx")
            runners = [("eager", model), ("exact", exact), ("fast", fast)] + ([("ort", ort)] if ort else [])
            with torch.no_grad():
                want = model(x)
                err = ((fast(x) - want).abs().max() / want.abs().max()).item()
                best = {}
                for _ in range(rounds):
                    for k, f in runners:
                        t = min(timeit.repeat(lambda f=f, x=x: f(x), number=5, repeat=5)) / 5
                        best[k] = min(best.get(k, float("inf")), t)
            e, x_, f = best["eager"] * 1e3, best["exact"] * 1e3, best["fast"] * 1e3
            o = best.get("ort", float("nan")) * 1e3
            print(
                f"| {name} | {e:.2f} ms | {x_:.2f} ms | {f:.2f} ms | {o:.2f} ms | {f / e:.2f} | {f / x_:.2f} | {f / o:.2f} | {err:.1e} |"
            )


if __name__ == "__main__":
    main()
