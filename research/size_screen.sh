#!/usr/bin/env bash
# A first screen of issue 42, item 3 (compressibility against model size): at 0.24M and 3.9M
# parameters (the smoke model is 1.1M; research/density_screen.sh screened it at these densities and more),
# the preconditioned update (precondition=adam, update=linear: the defaults) and DeMo's sign rule
# at several compressions, beside data-parallel AdamW and one worker alone. 4 workers of 512
# tokens, one text (PART: sh or ca), seed 0, 150 steps, one lr per arm (the 1.1M model's tuned
# bests: AdamW and sign 4e-3, alone 2e-3, the preconditioned update 1e-3): a screen, not best
# against best. Finished runs are skipped, interrupted ones resume.
#
# At 12.3M (about 3x the 3.9M model's time) only AdamW, alone, the defaults at top-4 of 16x16 and of
# 64x64 and the sign rule at top-4 of 64x64.
#
#   bash research/size_screen.sh [OUT] PART [SIZE...]    # SIZE: 0.24m, 3.9m, 12.3m (default 0.24m 3.9m)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/size}
PART=${2:?PART: sh or ca}
shift 2 || true
SIZES=("${@:-0.24m 3.9m}")
mkdir -p "$OUT"
. research/_common.sh
text_part "$PART"  # sets EXTRA
P="distro:lr=0.001"  # the defaults: top-4 of 16x16 chunks
S="distro:update=sign"  # top-4 of 64x64 chunks
ARMS="adamw,alone:lr=0.002,$P,$P,chunk=32,topk=8,$P,chunk=64,topk=16,$P,chunk=64,$S,chunk=16,$S"
BASE=(--steps 150 --lr 0.004 --seeds 0 --no-plots --torch-threads 1 --no-alone "${EXTRA[@]}")
for size in ${SIZES[*]}; do
    case $size in
        0.24m) SHAPE=(--n-layers 2 --d-model 64 --n-heads 2 --d-ff 192) ;;
        3.9m) SHAPE=(--n-layers 4 --d-model 256 --n-heads 4 --d-ff 768) ;;
        12.3m) SHAPE=(--n-layers 6 --d-model 384 --n-heads 6 --d-ff 1152) ;;
        *) echo "SIZE must be 0.24m, 3.9m or 12.3m, not '$size'" >&2; exit 2 ;;
    esac
    arms=$ARMS
    [ "$size" = 12.3m ] && arms="adamw,alone:lr=0.002,$P,$P,chunk=64,$S"
    run "size-$PART-$size" "${BASE[@]}" "${SHAPE[@]}" --arms "$arms"
done
