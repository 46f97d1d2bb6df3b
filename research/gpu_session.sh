#!/usr/bin/env bash
# One GPU session's measurements, each under its own time limit, every number and log in one folder
# small enough to come back from the device machine (checkpoints are removed at the end):
#   1. research/gpu_parity.sh (34M parameters, 4 workers, 150 steps: AdamW, alone, the defaults,
#      the best per-step recipe, local steps), at most PARITY_S seconds (default 300);
#   2. scripts/gpu_check.sh (NCCL and CUDA tests, bench_step.py at 5M and 1.14B), at most CHECK_S
#      seconds (default 180).
# A part cut by its limit leaves what it wrote (the runner's metrics; --resume continues it).
#
#   bash research/gpu_session.sh OUT [runner flags for the parity run...]          # on a CUDA machine
#   bash research/gpu_session.sh OUT --tiny [runner flags for the parity run...]   # CPU test of the same steps
#
# --tiny runs the parity script at its CPU size and, in place of gpu_check.sh (which needs CUDA),
# bench_step.py on the CPU at the 5M shapes. OUT gets env.txt (machine, torch, CUDA), parity.log
# and parity/ (summary.md, summary.json, metrics.jsonl), check.log and status.txt (each part's exit
# code and seconds). Exit code 0 when both parts finished, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:?usage: bash research/gpu_session.sh OUT [--tiny] [runner flags...]}
shift
TINY=()
if [ "${1:-}" = "--tiny" ]; then
    TINY=(--tiny)
    shift
fi
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
    echo "error: $OUT exists and is not empty; choose another OUT" >&2
    exit 2
fi
mkdir -p "$OUT" || exit 2

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -srm), $(nproc) CPUs"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', torch.cuda.device_count())"
    git rev-parse HEAD 2>/dev/null | sed 's/^/commit: /'
} > "$OUT/env.txt" 2>&1

part() {  # NAME LIMIT_S COMMAND...: run it under its limit, log it, record its exit code and seconds
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start)) limit=$limit" >> "$OUT/status.txt"
    return $rc
}

part parity "${PARITY_S:-300}" bash research/gpu_parity.sh "$OUT/parity" "${TINY[@]}" --no-plots "$@"
parity_rc=$?
if [ ${#TINY[@]} -gt 0 ]; then
    part check "${CHECK_S:-180}" "$PY" benchmarks/bench_step.py --device cpu --model 5m --steps 2 --rounds 1 --threads 1
else
    part check "${CHECK_S:-180}" env PYTHON="$PY" bash scripts/gpu_check.sh
fi
check_rc=$?
rm -rf "$OUT/parity/checkpoints"
echo "size: $(du -sk "$OUT" | cut -f1) KiB" >> "$OUT/status.txt"
cat "$OUT/status.txt"
[ $parity_rc -eq 0 ] && [ $check_rc -eq 0 ]
