#!/usr/bin/env bash
# The update-rule study behind docs/results-workers.md (issue 42, item 4): the sign step of the
# defaults against an Adam-preconditioned momentum applied without the sign
# (precondition=adam, update=linear; the same 920.6x), beside data-parallel AdamW and the alone arm
# the runner adds, at 4 workers x 512 tokens (smoke) and 16 workers x 128 tokens (volunteer): the
# same 2,048-token global batch, 150 steps (as research/regime_study.sh), contiguous shards,
# seeds 0 and 1. Every arm runs a three-point lr grid, 0.5x, 1x and 2x of its own lr: 4e-3 for AdamW, alone and the defaults
# (best at 4e-3 in the tuned study), 1e-3 for the preconditioned arm (best at 1e-3 in a first look
# at 2.5e-4..16e-3, 300 steps). PART: sh (Shakespeare), ca (the Canterbury texts) or all; two PARTs
# run side by side on two cores. About 30 minutes per point on one busy core; finished runs are
# skipped, interrupted ones resume. Tables: $OUT/NAME/summary.md.
#
#   bash research/precondition_study.sh [OUT] [PART]      # OUT defaults to runs/precondition, PART to all
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/precondition}
PART=${2:-all}
mkdir -p "$OUT"
. research/_common.sh
ARMS="adamw,distro:update=sign,distro:precondition=adam,update=linear,lr=0.001,chunk=64"
GRID=(--lr 0.004 --steps 150 --seeds 0,1 --arms "$ARMS" --no-plots --sweep "lr=0.5x,1x,2x")

points() {  # points PREFIX [ARGS...]: the 4- and the 16-worker point
    local prefix=$1
    shift
    run "$prefix-w4" --preset smoke "${GRID[@]}" "$@"
    run "$prefix-w16" --preset volunteer "${GRID[@]}" "$@"
}

if [ "$PART" = sh ] || [ "$PART" = all ]; then
    points sh
fi
if [ "$PART" = ca ] || [ "$PART" = all ]; then
    CORPUS="$OUT/corpus-canterbury"  # made once, as research/regime_study.sh makes it
    canterbury_corpus "$CORPUS"
    points ca --corpus "$CORPUS"
fi
