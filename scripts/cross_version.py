"""Part of scripts/torch_versions.sh: the first torch version saves a small program to PATH;
each later one loads and runs it against eager."""

import os
import sys

import torch

import kwexport

path = sys.argv[1]
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)).eval()
x = torch.randn(3, 8)
if not os.path.exists(path):
    kwexport.save(kwexport.export(m, (x,)), path)
    print(f"saved the shared file with torch {torch.__version__}")
else:
    prog = kwexport.load(path)
    with torch.no_grad():
        torch.testing.assert_close(prog(x), m(x))
    d = prog.dispatch
    print(
        f"ran the file saved by torch {prog.producer['torch']} "
        f"({d['stable_abi']} nodes on the C path, {d['python']} on Python)"
    )
