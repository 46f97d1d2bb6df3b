#!/usr/bin/env bash
# Issue 42, item 3, best against best at one model size: the arms of size_screen.sh (AdamW, one
# worker alone, the preconditioned update of the defaults at 77.6x, 153x, 277x and 893x, DeMo's sign
# rule at 77.6x and 893x), each on the same three-point lr grid around its own 1.1M best (0.5x, 1x,
# 2x: AdamW and sign 4e-3, alone 2e-3, the preconditioned update 1e-3), seeds 0 and 1, 4 workers of
# 512 tokens, 150 steps, one text (PART: sh or ca). The summary reports each arm's tuned point;
# docs/results-workers.md, "Model size", the R of every arm at it. Finished runs are skipped,
# interrupted ones resume. At 3.9M (about 8x the 0.24M time) the arms are AdamW, alone, the
# defaults at 77.6x and 893x and the sign rule at 77.6x.
#
#   bash research/size_study.sh [OUT] PART SIZE    # SIZE: 0.24m or 3.9m
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/size}
PART=${2:?PART: sh or ca}
SIZE=${3:?SIZE: 0.24m or 3.9m}
mkdir -p "$OUT"
. research/_common.sh
text_part "$PART"  # sets EXTRA
P="distro:lr=0.001"  # the defaults: top-4 of 16x16 chunks
S="distro:update=sign"  # top-4 of 64x64 chunks
case $SIZE in
    0.24m)
        SHAPE=(--n-layers 2 --d-model 64 --n-heads 2 --d-ff 192)
        ARMS="adamw,alone:lr=0.002,$P,$P,chunk=32,topk=8,$P,chunk=64,topk=16,$P,chunk=64,$S,chunk=16,$S"
        ;;
    3.9m)
        SHAPE=(--n-layers 4 --d-model 256 --n-heads 4 --d-ff 768)
        ARMS="adamw,alone:lr=0.002,$P,$P,chunk=64,$S,chunk=16"
        ;;
    *) echo "SIZE must be 0.24m or 3.9m, not '$SIZE'" >&2; exit 2 ;;
esac
run "tuned-$PART-$SIZE" --steps 150 --lr 0.004 --seeds 0,1 --sweep "lr=0.5x,1x,2x" --no-plots \
    --torch-threads 1 --no-alone "${EXTRA[@]}" "${SHAPE[@]}" --arms "$ARMS"
