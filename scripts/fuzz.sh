#!/usr/bin/env bash
# Runs each fuzz target for a fixed budget (seconds, default 60) from the seed corpus.
# cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets the stable toolchain accept them.
# Crashers land in fuzz/artifacts/<target>/: turn each into a regression test.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
budget=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
# The targets depend on kwexport-core alone: no Python is needed.
export RUSTC_BOOTSTRAP=1
for target in container header treespec; do
    mkdir -p "corpus/$target"
    cargo fuzz run "$target" "corpus/$target" "seeds/$target" -- -max_total_time="$budget" -max_len=65536
done
