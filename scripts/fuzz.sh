#!/usr/bin/env bash
# Runs each fuzz target for a fixed budget (seconds, default 60) from the seed corpus.
# cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets the stable toolchain accept them.
# Crashers land in fuzz/artifacts/<target>/: turn each into a regression test.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
budget=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
export RUSTC_BOOTSTRAP=1
export PYO3_PYTHON=${PYO3_PYTHON:-$(cd .. && pwd)/.venv/bin/python}
for target in container header treespec; do
    mkdir -p "corpus/$target"
    cargo fuzz run "$target" "corpus/$target" "seeds/$target" -- -max_total_time="$budget" -max_len=65536
done
