#!/usr/bin/env bash
# Clean exits (issue 43): each documented launch of docs/examples, N times in a row with a CPU-bound
# job beside it; every exit status and any abort line is recorded. A run passes when its status is 0
# and its output holds no "terminate called", "Aborted" or "core dumped".
#
#   bash research/exit_loop.sh [N] [OUT]     # N defaults to 20, OUT to runs/exit_loop
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
OUT=${2:-runs/exit_loop}
mkdir -p "$OUT"
BIN=.venv/bin
python3 -c 'while True: pass' &   # the CPU hog
HOG=$!
trap 'kill $HOG 2>/dev/null' EXIT
launches=(
  "torchrun_loop|$BIN/torchrun --nproc-per-node 2 docs/examples/torchrun_loop.py"
  "hf_trainer|$BIN/torchrun --nproc-per-node 2 docs/examples/hf_trainer.py"
  "accelerate_loop|$BIN/accelerate launch --multi_gpu --num_processes 2 docs/examples/accelerate_loop.py"
)
for entry in "${launches[@]}"; do
  name=${entry%%|*}; cmd=${entry#*|}
  bad=0
  for i in $(seq 1 "$N"); do
    log="$OUT/$name.$i.log"
    timeout 300 $cmd >"$log" 2>&1
    rc=$?
    if [ $rc -ne 0 ] || grep -qE "terminate called|Aborted|core dumped" "$log"; then
      bad=$((bad + 1)); echo "$name run $i: exit $rc (log $log)"
    fi
  done
  echo "$name: $((N - bad)) of $N clean" | tee -a "$OUT/summary.txt"
done
