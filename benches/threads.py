"""`optimize="fast"` at one thread and at two, on benches/optimize.py's workloads (kwexport
only): each model's call at `torch.set_num_threads(1)`, then `(2)`, best of five 0.3 s rounds,
and the ratio. kwexport's kernels split their work on torch's intra-op pool, so
`set_num_threads` governs them as it governs torch's. Run it from two checkouts, processes
alternating, to compare code before and after a change (BENCHMARKS.md, "Performance IV").

    python benches/threads.py
"""

import tempfile
import time
from pathlib import Path

import torch
from optimize import MODELS

import kwexport


def best(call, rounds=5, seconds=0.3):
    for _ in range(3):
        call()
    times = []
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            call()
            n += 1
        times.append((time.perf_counter() - start) / n)
    return min(times)


def main():
    torch.manual_seed(0)
    print("| model | 1 thread | 2 threads | 2 / 1 |\n| --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, build, make_kwargs) in enumerate(MODELS):
            kwargs = make_kwargs()
            path = Path(tmp) / f"{i}.kwx"
            kwexport.save(kwexport.export(build().eval(), (), kwargs), path)
            prog = kwexport.load(path, optimize="fast")
            times = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                times[threads] = best(lambda prog=prog, kwargs=kwargs: prog(**kwargs))
            one, two = times[1], times[2]
            print(f"| {name} | {one * 1e3:.3f} ms | {two * 1e3:.3f} ms | {two / one:.2f} |")


if __name__ == "__main__":
    main()
