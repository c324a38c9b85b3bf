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
# The `fast` checks again with each other kernel family this CPU runs forced (`KWEXPORT_ISA`):
# every family is checked against eager through the public API.
others=$(.venv/bin/python -c "import kwexport; i = kwexport.kernel_info(); print(*(f for f in i['supported'] if f != i['isa']))")
for isa in $others; do
    echo "== KWEXPORT_ISA=$isa"
    KWEXPORT_ISA=$isa .venv/bin/python -m pytest -q tests/test_optimize.py tests/test_nonfinite.py tests/test_zoo.py tests/test_quantized.py
done
