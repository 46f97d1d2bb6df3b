#!/usr/bin/env bash
# The GPU check of the parity study: AdamW, the alone baseline (one worker, no network; the runner
# adds it), DisTrOAdamW's defaults, the best per-step recipe at >= 1000x and local steps on a
# 34M-parameter model (8 layers, width 512) at 32,768 tokens per worker-step (32 x 1,024), 4 workers
# sharing one GPU as in-process threads, bf16 autocast, on the prepared Shakespeare corpus. Sized for
# about 5 minutes on one H200 (150 steps per arm); the sizing is an estimate until it has run there.
#
#   bash research/gpu_parity.sh OUT [runner flags...]          # on a machine with CUDA
#   bash research/gpu_parity.sh OUT --tiny [runner flags...]   # the same arms, CPU-sized (20 steps: one sync)
#
# What it needs on the GPU machine: this repository with torch and the package installed, and the
# token cache of `python -m experiments.prepare` (.cache/distro-opt/corpora/shakespeare, 4 MB).
# Runner flags after OUT override the sizes (e.g. --steps 100), as on experiments.run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:?usage: bash research/gpu_parity.sh OUT [--tiny] [runner flags...]}
shift
LOCAL="distro:sync_every=16,topk=12,bits=2,embed.topk=31,matrix.topk=6"
RECIPE="distro:update=sign,topk=3,decay=0.9,warmup_for=12,warmup_topk=16"
SIZE=(--device cuda --torch-threads 0 --n-layers 8 --d-model 512 --n-heads 8 --d-ff 2048
      --seq-len 1024 --batch-size 32 --steps 150 --warmup-steps 15 --eval-every 50
      --eval-batches 8 --eval-batch-size 16 --checkpoint-every 50)
if [ "${1:-}" = "--tiny" ]; then
    shift
    SIZE=(--device cpu --torch-threads 1 --n-layers 1 --d-model 32 --n-heads 2 --d-ff 64
          --seq-len 32 --batch-size 2 --steps 20 --warmup-steps 2 --eval-every 10
          --eval-batches 1 --eval-batch-size 2 --checkpoint-every 10)
fi
exec "$PY" -m experiments.run --preset smoke --workers 4 --autocast bf16 --no-progress \
    --arms "adamw,distro,$RECIPE,$LOCAL" "${SIZE[@]}" --out "$OUT" "$@"
