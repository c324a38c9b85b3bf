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
    # A wheel, not `maturin develop`: an editable install would put this torch's build of the
    # extension into python/, over the dev venv's.
    rm -rf "$env/wheel"
    VIRTUAL_ENV="$PWD/$env" PATH="$PWD/$env/bin:$PATH" "$env/bin/maturin" build --release -q -o "$env/wheel"
    "$env/bin/python" -m pip install -q --force-reinstall --no-deps "$env"/wheel/kwexport-*.whl
    result=$("$env/bin/python" -m pytest -q -p no:cacheprovider tests \
        --ignore=tests/test_ray_serve.py --ignore=tests/test_wheel.py 2>&1 | tee "$env/pytest.log" | tail -1)
    # The first version saves a file; every later one loads and runs it.
    cross=$("$env/bin/python" scripts/cross_version.py "$shared" 2>&1 | tail -1)
    summary+=("torch $v: $result; $cross")
done
printf '%s\n' "${summary[@]}"
