#!/usr/bin/env bash
# The density screen behind docs/results-workers.md, "Density and the preconditioned update" (issue
# 42, items 3-5): the sign step and precondition=adam, update=linear at several densities (chunk,
# top-k), beside data-parallel AdamW and one worker alone at lr 2e-3 (the alone arm's best in the
# update-rule study), at 4 workers (smoke) and 16 (volunteer), one text (PART: sh or ca), seed 0,
# 150 steps, one lr per arm: a screen to choose what the tuned study runs, not best against best.
# About 25 minutes per PART on one core; two PARTs run side by side.
#
#   bash research/density_screen.sh [OUT] PART
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/density}
PART=${2:?PART: sh or ca}
mkdir -p "$OUT"
. research/_common.sh
text_part "$PART"  # sets EXTRA
P="distro:precondition=adam,update=linear"
S="distro:update=sign"  # DeMo's rule: 64x64 chunks
P64="$P,chunk=64"
BASE=(--steps 150 --lr 0.004 --seeds 0 --no-plots --torch-threads 1 --no-alone "${EXTRA[@]}")
run "screen-$PART" "${BASE[@]}" --arms "adamw,alone:lr=0.002,$S,$S,topk=16,$S,chunk=16,\
$S,topk=32,bits=2,$P64,lr=0.001,$P64,lr=0.001,topk=16,$P,lr=0.001,chunk=16"
run "screen2-$PART-w4" "${BASE[@]}" --arms "adamw,alone:lr=0.002,$P,lr=0.002,chunk=16,$P,lr=0.0005,chunk=16,\
$P,lr=0.001,chunk=16,topk=2,$P,lr=0.001,chunk=32,topk=8,$P,lr=0.001,chunk=32,topk=4,$P64,lr=0.002,topk=16"
run "screen2-$PART-w16" --preset volunteer "${BASE[@]}" --arms "adamw,alone:lr=0.002,alone:lr=0.001,$S,\
$P64,lr=0.001,$P,lr=0.001,chunk=16,$P64,lr=0.001,topk=16,$P,lr=0.001,chunk=32,topk=4"
