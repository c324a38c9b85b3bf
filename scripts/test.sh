#!/usr/bin/env bash
# The whole test suite: Rust unit tests, then the Python behaviour tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The core needs no Python; the runtime's tests link libpython, so point PyO3 at the same
# interpreter as the tests.
env -u PYO3_PYTHON cargo test --locked -p kwexport-core
PYO3_PYTHON="$PWD/.venv/bin/python" cargo test --locked -p kwexport-runtime
.venv/bin/python -m pytest -q
