#!/usr/bin/env bash
# Release artifacts: one wheel per supported CPython (3.10 to 3.13), tagged manylinux2014
# (glibc 2.17, so they install on every common serving image), built with zig as the linker;
# and an sdist. Per-version wheels rather than one abi3 wheel: the limited API costs the call
# path about 5% (BENCHMARKS.md, "Wheels"). Run after scripts/setup.sh; writes to dist/.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q ziglang
VERSIONS=${VERSIONS:-"3.10 3.11 3.12 3.13"}
interpreters=()
for v in $VERSIONS; do
    interpreters+=("python$v")
done
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" \
    maturin build --release --zig --compatibility manylinux_2_17 -i "${interpreters[@]}" -o dist
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" maturin sdist -o dist
ls -l dist
