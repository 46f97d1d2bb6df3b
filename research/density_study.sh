#!/usr/bin/env bash
# The tuned confirmation behind docs/results-workers.md, "The preconditioned update at 78x and 154x"
# (issue 42, items 4-5): precondition=adam, update=linear (P) at chunk=16 (77.9x) and at
# chunk=32,topk=8 (154.4x), the two densities research/density_screen.sh ranked first, against
# data-parallel AdamW, one worker alone and DeMo's sign rule (`update=sign`, 920.6x), at 4 workers (smoke)
# and 16 (volunteer), one text (PART: sh or ca), seeds 0 and 1, 150 steps. Every arm runs the same
# three-point lr grid (0.5x, 1x, 2x of its own lr): AdamW and the defaults 4e-3, alone 2e-3, P 1e-3
# at 4 workers and 5e-4 at 16 (the screen's best, and the update-rule study's best at 16 workers
# lay at the grid's low edge). About 45 minutes per PART on one core; two PARTs run side by side;
# finished runs are skipped, interrupted ones resume. Tables: $OUT/NAME/summary.md.
#
#   bash research/density_study.sh [OUT] PART      # OUT defaults to runs/density
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/density}
PART=${2:?PART: sh or ca}
mkdir -p "$OUT"
. research/_common.sh
text_part "$PART"  # sets EXTRA
P="distro:precondition=adam,update=linear"
BASE=(--steps 150 --lr 0.004 --seeds 0,1 --no-plots --torch-threads 1 --no-alone --sweep "lr=0.5x,1x,2x"
    "${EXTRA[@]}")
run "tuned-$PART-w4" --preset smoke "${BASE[@]}" \
    --arms "adamw,alone:lr=0.002,distro:update=sign,$P,lr=0.001,chunk=16,$P,lr=0.001,chunk=32,topk=8"
run "tuned-$PART-w16" --preset volunteer "${BASE[@]}" \
    --arms "adamw,alone:lr=0.002,distro:update=sign,$P,lr=0.0005,chunk=16,$P,lr=0.0005,chunk=32,topk=8"
# Where a best point sat at the grid's edge (alone at 4e-3 on Shakespeare, the defaults at 8e-3 at 4
# workers): one step further, so that the tuned alone arm R is measured against is not held back.
run "tuned-$PART-w4-edge" --preset smoke --steps 150 --lr 0.004 --seeds 0,1 --no-plots --torch-threads 1 \
    --no-alone "${EXTRA[@]}" --arms "alone:lr=0.008,distro:update=sign,lr=0.016"
