#!/usr/bin/env bash
# flashtile.triton on an NVIDIA GPU in under five minutes (written for an H200):
#   1. the CUDA test subset: the interpreter tests, run on the compiled kernels
#      (float16/bfloat16 judged by FlashAttention's rule: at most 2x the error of
#      the same attention computed by PyTorch in that precision);
#   2. timings of the forward, forward+backward and decoding against SDPA's flash
#      and cuDNN backends, a measured bf16 matmul rate and copy bandwidth, written
#      to $OUT/gpu_check.json, with a markdown table for docs/benchmarks-gpu.md.
#
# Usage: scripts/gpu_check.sh            (on the GPU machine, from any directory)
#        scripts/gpu_check.sh --dry-run  (no GPU: tiny sizes in Triton's interpreter)
# Environment: PYTHON (default python3), OUT (default ./gpu-check-out).
# Exit status: 0 all good, 1 a test or an accuracy check failed, 2 no usable setup.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
log() { echo "[gpu_check $(date +%T)] $*"; }
status=0

A=tests/test_triton_attention.py
D=tests/test_triton_decode.py
if [[ $DRY == 1 ]]; then
    export TRITON_INTERPRET=1
    TEST_GROUPS=("basics|$A|plain" "decode|$D|contiguous_cache")
    BENCH=(--dry-run)
else
    export TRITON_INTERPRET=0
    # One configuration per kernel in the tests: every tuning candidate would
    # multiply the compiles (seconds each), and the tests judge accuracy only.
    export FLASHTILE_TRITON_TUNE=0
    # Each group compiles its own kernels; the groups run at once on separate cores.
    TEST_GROUPS=(
        "basics|$A|plain or tq_above or three_dim or rows_without"
        "half|$A|float16 or bfloat16_softcap"
        "variants|$A|bfloat16_window or varlen or mqa"
        "rest|$A|kv_lengths or one_query or window_both or tq_below or compile or round or fake or bad"
        "decode|$D|"
    )
    BENCH=(--budget 150)
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"
fi

log "environment"
"$PY" - <<'PYEOF' | tee "$OUT/environment.txt" || exit 2
import os, sys
import torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__)
if os.environ["TRITON_INTERPRET"] == "0":
    if not torch.cuda.is_available():
        sys.exit("torch sees no CUDA device: install PyTorch's CUDA build (it brings Triton)")
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
PYEOF

log "tests in ${#TEST_GROUPS[@]} groups at once (TRITON_INTERPRET=$TRITON_INTERPRET)"
for group in "${TEST_GROUPS[@]}"; do
    IFS="|" read -r name file expr <<< "$group"
    (
        timeout 170 "$PY" -m pytest -q -p no:cacheprovider "$file" ${expr:+-k "$expr"} \
            --junitxml="$OUT/tests-$name.xml" > "$OUT/tests-$name.txt" 2>&1
        echo $? > "$OUT/tests-$name.rc"
    ) &
done
wait
for group in "${TEST_GROUPS[@]}"; do
    name=${group%%|*}
    rc=$(cat "$OUT/tests-$name.rc" 2>/dev/null || echo missing)
    echo "  $name: $(tail -n 1 "$OUT/tests-$name.txt") (status $rc)"
    if [[ $rc != 0 ]]; then
        status=1
        tail -n 30 "$OUT/tests-$name.txt"
    fi
done

log "benchmarks"
timeout 210 "$PY" -m flashtile.triton.gpucheck "${BENCH[@]}" --json "$OUT/gpu_check.json" \
    2>&1 | tee "$OUT/gpu_check.md"
bench_rc=${PIPESTATUS[0]}
if [[ $bench_rc != 0 ]]; then
    log "benchmark failed, inaccurate or timed out (status $bench_rc; 124 = timeout)"
    status=1
fi
log "done: results in $OUT (status $status)"
exit $status
