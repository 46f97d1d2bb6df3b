#!/usr/bin/env bash
# The regime study behind docs/results-tuned.md ("The regime, tuned"): the tuned gap of the defaults
# against AdamW as tokens per worker-step and model width grow, on the smoke model's settings
# otherwise (4 workers, contiguous shards, Shakespeare, 150 steps). Both arms run on the same lr grid
# at every point, seeds 0 and 1, and each arm's best point is compared per seed:
# - 512 tokens per worker-step (4 x 128), width 128: lr 2e-3 to 16e-3;
# - width 64 (d_ff 192): lr 0.5e-3 to 16e-3 (AdamW's best was on the top edge of 2e-3..8e-3);
# - 2,048 tokens per worker-step (16 x 128): lr 4e-3 to 16e-3 (larger batches take larger lrs);
# - width 256 (d_ff 768): lr 2e-3 to 8e-3, then 1e-3 as its own run (AdamW's best was on the low
#   edge of 2e-3..8e-3); the tuned point is the best of the two summaries' four points per arm;
# - a fixed token budget: rg-t2k's 150 x 2,048 tokens as 600 steps of 512 tokens, lr 2e-3 to 8e-3,
#   then 16e-3 as its own run (the defaults' best was on the top edge);
# - the second text: the 512- and 2,048-token points on the Canterbury texts (ca-rg-*), same grids.
# About 140 minutes on 2 CPU cores; finished runs are skipped, interrupted ones resume. Summaries:
# $OUT/NAME/summary.md, each with its tuned table.
#
#   bash research/regime_study.sh [OUT]      # OUT defaults to runs/regime
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/regime}
mkdir -p "$OUT"
. research/_common.sh
POINT=(--preset smoke --seeds 0,1 --arms adamw,distro:update=sign --no-plots --steps 150)
run rg-t512 "${POINT[@]}" --sweep "lr=2x,4x,8x,16x"
run rg-w64 "${POINT[@]}" --sweep "lr=0.5x,1x,2x,4x,8x,16x" --d-model 64 --d-ff 192
run rg-t2k "${POINT[@]}" --sweep "lr=4x,8x,16x" --batch-size 16
run rg-w256 "${POINT[@]}" --sweep "lr=2x,4x,8x" --d-model 256 --d-ff 768
run rg-w256-lr1 "${POINT[@]}" --sweep "lr=1x" --d-model 256 --d-ff 768
# the token budget of rg-t2k (150 steps of 2,048 tokens) spent as 600 steps of 512 tokens
run rg-t512-s600 --preset smoke --seeds 0,1 --arms adamw,distro:update=sign --no-plots --steps 600 --sweep "lr=2x,4x,8x"
run rg-t512-s600-lr16 --preset smoke --seeds 0,1 --arms adamw,distro:update=sign --no-plots --steps 600 --sweep "lr=16x"
# the second text (its corpus is made once, as research/tuned_study.sh makes it)
CORPUS="$OUT/corpus-canterbury"
canterbury_corpus "$CORPUS"
run ca-rg-t512 "${POINT[@]}" --corpus "$CORPUS" --sweep "lr=2x,4x,8x,16x"
run ca-rg-t2k "${POINT[@]}" --corpus "$CORPUS" --sweep "lr=4x,8x,16x" --batch-size 16
