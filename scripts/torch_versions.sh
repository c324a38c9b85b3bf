#!/usr/bin/env bash
# The torch versions kwexport claims, tested for real: one venv per version under
# .torch-versions/, kwexport built into each, the test suite run there, and a file saved by
# the first version loaded and run by every other. Outside CI: each torch wheel is a few GB.
#
#     bash scripts/torch_versions.sh [VERSION ...]     (default: 2.11.0 2.13.0 2.15.0)
#
# Prints one line per version: the suite's summary, and whether the cross-version file ran.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(2.11.0 2.13.0 2.15.0)
PYTHON=${PYTHON:-python3.11}
mkdir -p .torch-versions
shared=.torch-versions/shared.kwx
summary=()
for v in "${VERSIONS[@]}"; do
    env=.torch-versions/torch-$v
    [ -x "$env/bin/python" ] || "$PYTHON" -m venv "$env"
    "$env/bin/python" -m pip install -q --upgrade pip
    # transformers and torchvision at versions that work with this torch (the zoo skips
    # without them).
    "$env/bin/python" -m pip install -q "torch==$v" numpy pytest hypothesis optree "maturin>=1.9,<2" || {
        summary+=("torch $v: could not install")
        continue
    }
    VIRTUAL_ENV="$PWD/$env" PATH="$PWD/$env/bin:$PATH" "$env/bin/maturin" develop --release -q
    result=$("$env/bin/python" -m pytest -q -p no:cacheprovider tests \
        --ignore=tests/test_ray_serve.py --ignore=tests/test_wheel.py 2>&1 | tail -1)
    # The first version saves a file; every later one loads and runs it.
    cross=$("$env/bin/python" - "$shared" <<'PY'
import os, sys, torch, kwexport
path = sys.argv[1]
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)).eval()
x = torch.randn(3, 8)
if not os.path.exists(path):
    kwexport.save(kwexport.export(m, (x,)), path)
    print(f"saved with torch {torch.__version__}")
else:
    prog = kwexport.load(path)
    torch.testing.assert_close(prog(x), m(x))
    print(f"loaded and ran a file saved by torch {prog.producer['torch']}; dispatch {prog.dispatch['stable_abi']} C / {prog.dispatch['python']} Python")
PY
)
    summary+=("torch $v: $result; $cross")
done
printf '%s\n' "${summary[@]}"
