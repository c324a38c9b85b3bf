#!/usr/bin/env bash
# The whole test suite: Rust unit tests, then the Python behaviour tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# cargo test links libpython; point PyO3 at the same interpreter as the tests.
PYO3_PYTHON="$PWD/.venv/bin/python" cargo test --locked
.venv/bin/python -m pytest -q
