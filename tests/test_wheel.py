"""The built wheel installs into a fresh virtual environment, with no Rust toolchain or source
tree in sight, and runs a program saved here. (Release wheels for every supported CPython
come from scripts/wheels.sh; this builds the one for the running interpreter.)"""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch

import kwexport

ROOT = Path(__file__).parent.parent
MATURIN = shutil.which("maturin") or str(Path(sys.executable).parent / "maturin")


@pytest.mark.skipif(not os.path.exists(MATURIN), reason="maturin is not installed")
def test_the_wheel_runs_a_saved_program_in_a_fresh_venv(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(2, 4)
    kwexport.save(kwexport.export(m, (x,)), tmp_path / "m.kwx")
    torch.save((x, m(x).detach()), tmp_path / "io.pt")

    built = subprocess.run(
        [MATURIN, "build", "--release", "-q", "-i", sys.executable, "-o", str(tmp_path / "wheels")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheels").glob("kwexport-*.whl")

    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pip = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)], capture_output=True, text=True
    )
    assert pip.returncode == 0, pip.stderr
    # torch (a few GB) comes from this environment's site-packages, appended after the fresh
    # one's: kwexport itself can only come from the wheel.
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    )
    Path(site.stdout.strip(), "torch_from_dev.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = f"""
import kwexport, torch
assert kwexport.__file__.startswith({str(env_dir)!r}), kwexport.__file__
x, want = torch.load({str(tmp_path / "io.pt")!r})
got = kwexport.load({str(tmp_path / "m.kwx")!r})(x)
assert torch.equal(got, want), (got, want)
print("ok", kwexport.__version__)
"""
    run = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"ok {kwexport.__version__}"


@pytest.mark.skipif(shutil.which("objdump") is None, reason="binutils' objdump is not installed")
def test_the_extensions_kernels_inline_every_simd_intrinsic():
    """A SIMD intrinsic compiled as a call shows a kernel that lost its target features: a
    closure's body (`array::from_fn`, a thread-local's `with`) compiled on its own, without the
    features of the function it was written in. Correct, and 7× slower: the int8 AMX
    convolutions ran so until it was caught. Only the CPU detection may call one."""
    from kwexport import _rt

    listing = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", _rt.__file__], capture_output=True, text=True, check=True
    ).stdout
    function, calls = "", set()
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line.split("<", 1)[1][:-2]
        elif "call" in line and "core_arch::" in line and "std_detect" not in function:
            calls.add(f"{function} -> {line.split('<', 1)[1].rstrip('>')}")
    assert not calls, "\n".join(sorted(calls))
