#!/usr/bin/env bash
# One leased-GPU session's checks, as one command (the device tool runs it in the repository
# root with $OUT for results): install the cp312 wheel carried in .whl, then run the STEPS
# asked for (default: the CUDA tests, then benches/gpu.py within BUDGET seconds). Build the
# wheel here first: maturin build --release -i python3.12 --compatibility off -o .whl
set -uo pipefail
BUDGET=${BUDGET:-270}
STEPS=${STEPS:-"tests bench"}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, kwexport; print('torch', torch.__version__, 'transformers', transformers.__version__)"
for step in $STEPS; do
    case $step in
    tests)
        timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_cuda_graphs.py tests/test_device.py tests/test_cuda_fused.py 2>&1 \
            | tee "$OUT/tests.log" | grep -v "DEBUG" | grep -v "^\s*$" | tail -40 ;;
    bench)
        timeout $((BUDGET + 90)) python3 benches/gpu.py --budget "$BUDGET" --out "$OUT/gpu.md" ${GPU_ARGS:---generate} \
            2> "$OUT/bench.err"
        echo "bench rc=$?"
        grep -v -i "warn" "$OUT/bench.err" | tail -8 ;;
    profile)
        timeout 240 python3 benches/gpu_profile.py --out "$OUT/profile.md" ${PROFILE_ARGS:-} 2> "$OUT/profile.err" \
            || tail -5 "$OUT/profile.err" ;;
    esac
done
