"""kwexport demo: export a model that takes keyword arguments, save it, load it in a fresh
process, call it, and time load and call beside torch.export for the same model.

    python examples/demo.py [--threads N]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import torch
from torch import nn

import kwexport


class Ranker(nn.Module):
    """Scores items for a query: positional, keyword-only, defaulted and **kwargs inputs."""

    def __init__(self, d=64):
        super().__init__()
        self.query = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.item = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, query, items, *, mask, temperature=0.5, **features):
        q = self.norm(self.query(query + features["context"]["user"]))
        k = self.norm(self.item(items + features["context"]["session"][0]))
        scores = (k @ q.unsqueeze(-1)).squeeze(-1) / temperature
        scores = scores.masked_fill(mask, float("-inf"))
        return {"scores": scores, "best": scores.argmax(-1)}


def inputs(batch=8, n_items=32, d=64):
    mask = torch.zeros(batch, n_items, dtype=torch.bool)
    mask[:, -4:] = True
    args = (torch.randn(batch, d), torch.randn(batch, n_items, d))
    kwargs = {"mask": mask, "context": {"user": torch.randn(batch, d), "session": [torch.randn(batch, 1, d)]}}
    return args, kwargs


# Runs in a fresh process: time from after `import torch` to the first call's return, then
# warm load and call times. Prints one JSON line.
CHILD = textwrap.dedent("""
    import json, sys, time, statistics
    import torch
    torch.set_num_threads(int(sys.argv[3]))
    which, path = sys.argv[1], sys.argv[2]
    args, kwargs = torch.load(path + ".inputs", weights_only=True)
    t0 = time.perf_counter()
    if which == "kwexport":
        import kwexport
        load = lambda: kwexport.load(path)
    else:
        load = lambda: torch.export.load(path).module()
    f = load()
    f(*args, **kwargs)
    cold = time.perf_counter() - t0
    loads = []
    for _ in range(5):
        t = time.perf_counter(); load(); loads.append(time.perf_counter() - t)
    for _ in range(20):
        f(*args, **kwargs)
    calls = []
    for _ in range(200):
        t = time.perf_counter(); f(*args, **kwargs); calls.append(time.perf_counter() - t)
    print(json.dumps({"cold": cold, "load": statistics.median(loads), "call": statistics.median(calls)}))
""")


def run_child(which, path, threads):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, which, path, str(threads)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    model = Ranker().eval()
    args, kwargs = inputs()

    with tempfile.TemporaryDirectory() as tmp:
        kw_path = os.path.join(tmp, "ranker.kwx")
        te_path = os.path.join(tmp, "ranker.pt2")
        kwexport.save(kwexport.export(model, args, kwargs), kw_path, extra_files={"model.txt": "Ranker demo"})
        torch.export.save(torch.export.export(model, args, kwargs), te_path)
        for p in (kw_path, te_path):
            torch.save((args, kwargs), p + ".inputs")

        prog = kwexport.load(kw_path)
        print(f"signature:   {prog.__name__}{prog.__signature__}")
        want = model(*args, **kwargs)
        reordered = {"context": kwargs["context"], "mask": kwargs["mask"]}
        got = prog(*args, **reordered)
        same = torch.allclose(got["scores"], want["scores"]) and torch.equal(got["best"], want["best"])
        print(f"kwargs in another order: {'same result as eager' if same else 'MISMATCH'}")
        try:
            prog(*args, mask=kwargs["mask"].float(), context=kwargs["context"])
        except kwexport.InputError as e:
            print(f"a wrong dtype, caught at the boundary: InputError: {e}")

        kw = run_child("kwexport", kw_path, opts.threads)
        te = run_child("torch.export", te_path, opts.threads)

    print(f"\nfresh process, {opts.threads} thread(s), times after `import torch`:")
    print(f"{'':28}{'kwexport':>12}{'torch.export':>14}{'ratio':>9}")
    rows = [
        ("load + first call (cold)", "cold", 1e3, "ms"),
        ("load (warm)", "load", 1e3, "ms"),
        ("call", "call", 1e6, "µs"),
    ]
    for label, key, scale, unit in rows:
        a, b = kw[key] * scale, te[key] * scale
        print(f"{label:28}{a:>9.1f} {unit}{b:>11.1f} {unit}{b / a:>8.1f}x")


if __name__ == "__main__":
    main()
