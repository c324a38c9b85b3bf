#!/usr/bin/env bash
# Style and types: rustfmt, clippy, ruff (check and format), stubtest on kwexport._rt's
# stubs, mypy --strict on an example of the public API. Run after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYO3_PYTHON="$PWD/.venv/bin/python"
if cargo tree -p kwexport-core --edges normal --prefix none | grep -q '^pyo3'; then
    echo "kwexport-core must not depend on pyo3" >&2
    exit 1
fi
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
.venv/bin/ruff check .
.venv/bin/ruff format --check .
(cd python && ../.venv/bin/python -m mypy.stubtest kwexport._rt --allowlist stubtest_allowlist.txt)
.venv/bin/python -m mypy --strict examples/typed_usage.py
echo "lint: all checks passed"
