#!/usr/bin/env bash
# Builds kwexport, then exports the bundled example model, loads it in a fresh process and
# compares load and call times with torch.export's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/demo.py "$@"
