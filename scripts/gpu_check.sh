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
# Environment: PYTHON (default python3), OUT (default ./gpu-check-out),
#              TEST_SECONDS / BENCH_SECONDS (the two phases' time limits).
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
# Wall-clock limits on a GPU: tests 110 s + benchmarks 160 s (+ start-up) stay
# under five minutes; the benchmark writes its JSON after every section, so a
# cut keeps what it measured. The dry run (the interpreter on a CPU) gets more.
TEST_SECONDS=${TEST_SECONDS:-$((DRY ? 600 : 110))}
BENCH_SECONDS=${BENCH_SECONDS:-$((DRY ? 600 : 160))}
status=0

A=tests/test_triton_attention.py
D=tests/test_triton_decode.py
R=tests/test_triton_dispatch.py
if [[ $DRY == 1 ]]; then
    export TRITON_INTERPRET=1
    TEST_GROUPS=("basics|$A|plain" "decode|$D|contiguous_cache" "dispatch|$R|router_routes")
    BENCH=(--dry-run)
else
    export TRITON_INTERPRET=0
    # One configuration per kernel in the tests: every tuning candidate would
    # multiply the compiles (seconds each), and the tests judge accuracy only.
    # The benchmarks below tune (FLASHTILE_TRITON_TUNE=1).
    export FLASHTILE_TRITON_TUNE=0
    # Each group compiles its own kernels (the compiles are most of a group's
    # time); the groups run at once, one per core, so no group holds many.
    TEST_GROUPS=(
        "plain|$A|plain or rows_without or three_dim"
        "gqa|$A|tq_above or tq_below or one_query"
        "fp16|$A|float16 and not bfloat16"
        "bf16|$A|bfloat16_softcap"
        "bf16-window-varlen|$A|bfloat16_window or varlen_matches"
        "variants|$A|mqa or window_both or kv_lengths"
        "ops|$A|compile or round or fake or bad"
        "training|$A|kept_out or dropout_and_sinks or precision_rule or torch_func"
        "decode|$D|"
        "dispatch|$R|"
        "flex|tests/test_triton_flex.py|"
    )
    BENCH=(--budget 110)
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
        timeout "$TEST_SECONDS" "$PY" -m pytest -q -p no:cacheprovider "$file" ${expr:+-k "$expr"} \
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
FLASHTILE_TRITON_TUNE=1 timeout "$BENCH_SECONDS" "$PY" -m flashtile.triton.gpucheck "${BENCH[@]}" --json "$OUT/gpu_check.json" \
    2>&1 | tee "$OUT/gpu_check.md"
bench_rc=${PIPESTATUS[0]}
if [[ $bench_rc != 0 ]]; then
    log "benchmark failed, inaccurate or timed out (status $bench_rc; 124 = timeout)"
    status=1
fi
log "done: results in $OUT (status $status)"
exit $status
