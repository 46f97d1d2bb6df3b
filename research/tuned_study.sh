#!/usr/bin/env bash
# The tuned comparison behind docs/results-tuned.md: every arm at the same learning-rate grid
# (local steps also at two outer lrs), seeds 0 and 1, on Shakespeare and on three Canterbury-corpus
# texts; each arm at its best point against AdamW at its best; then the recipes on top (error
# feedback, compression warm-up, clipping), and the two tuned frontiers.
# About 200 runs of a minute each on 2 CPU cores; finished runs are skipped, interrupted ones resume.
#
#   bash research/tuned_study.sh [OUT]      # OUT defaults to runs/study
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/study}
mkdir -p "$OUT"
. research/_common.sh
GRID="lr=2x,4x,8x"  # sh-p: lr=1x,2x,4x,8x (1x was the worst point of every arm there)
SPLIT="distro:update=sign,embed.topk=8,matrix.topk=2,decay=0.9"   # per-kind top-k (1,031x)
UNIFORM="distro:update=sign,topk=3,decay=0.9"                     # the same idea for every parameter (1,135x)
TOP3="distro:update=sign,topk=3"                                  # top-3 alone (1,135x)
LOCAL="distro:sync_every=16,topk=12,bits=2,embed.topk=31,matrix.topk=6"  # local steps (5,751x)
# recipes on top (issue 26): Psyche's error feedback, a compression warm-up, clipping
KEPT="distro:update=sign,feedback=kept,distro:update=sign,topk=3,decay=0.9,feedback=kept"
WARM="distro:update=sign,warmup_for=30,warmup_topk=32,distro:update=sign,topk=3,decay=0.9,warmup_for=15,warmup_topk=16"
WARM2="distro:update=sign,topk=2,warmup_for=15,warmup_topk=32,distro:update=sign,topk=2,decay=0.9,warmup_for=15,warmup_topk=32"  # 1,016x
WARM3="distro:update=sign,topk=3,decay=0.9,warmup_for=12,warmup_topk=16"  # 1,012x
CORPUS="$OUT/corpus-canterbury"
canterbury_corpus "$CORPUS"
TUNED=(--preset smoke --seeds 0,1 --sweep "$GRID")
run sh-p --preset smoke --seeds 0,1 --sweep "lr=1x,2x,4x,8x" --arms "adamw,distro:update=sign,$SPLIT"
run sh-u "${TUNED[@]}" --arms "$UNIFORM"
run ca-p "${TUNED[@]}" --corpus "$CORPUS" --arms "adamw,distro:update=sign,$UNIFORM"
run sh-t3 "${TUNED[@]}" --arms "$TOP3"
run ca-t3 "${TUNED[@]}" --corpus "$CORPUS" --arms "$TOP3"
run sh-l --preset smoke --seeds 0,1 --sweep "$GRID;outer_lr=0.7,1" --arms "$LOCAL"
run ca-l --preset smoke --seeds 0,1 --sweep "$GRID;outer_lr=0.7,1" --corpus "$CORPUS" --arms "$LOCAL"
run sh-fk "${TUNED[@]}" --arms "$KEPT"
run sh-wu "${TUNED[@]}" --arms "$WARM"
run sh-wu2 "${TUNED[@]}" --arms "$WARM2"
run ca-wu "${TUNED[@]}" --corpus "$CORPUS" --arms "$WARM"
run sh-wu3 "${TUNED[@]}" --arms "$WARM3"
run ca-wu3 "${TUNED[@]}" --corpus "$CORPUS" --arms "$WARM3"
run ca-wu2 "${TUNED[@]}" --corpus "$CORPUS" --arms "$WARM2"
# local steps: the inner lr grid widened to 1x (the best point above was on its low edge) and 0.5x,
# the outer lr to 0.5; the same arm with Muon as the inner optimizer (MuLoCo) on the same grid
run sh-l2 --preset smoke --seeds 0,1 --sweep "lr=0.5x,1x;outer_lr=0.5,0.7" --arms "$LOCAL"
run sh-l3 --preset smoke --seeds 0,1 --sweep "lr=1x,2x,4x;outer_lr=0.7,1" --arms "$LOCAL"
run sh-l8 --preset smoke --seeds 0,1 --sweep "lr=8x;outer_lr=0.7,1" --arms "$LOCAL"
run sh-mu --preset smoke --seeds 0,1 --sweep "lr=1x,2x,4x;outer_lr=0.7,1" --arms "$LOCAL,inner=muon"
run sh-mu8 --preset smoke --seeds 0,1 --sweep "lr=8x;outer_lr=0.7,1" --arms "$LOCAL,inner=muon"
# the peers' own code, 4 torch.distributed ranks per point, and the AdamW they pair with
run sh-a "${TUNED[@]}" --arms adamw
run sh-d "${TUNED[@]}" --arms distro:update=sign  # the sign rule on the same machine as the peers
run_ranks 4 sh-ps4 "${TUNED[@]}" --arms "powersgd:rank=4,start_iter=30"
run_ranks 4 sh-ps1 "${TUNED[@]}" --arms "powersgd:rank=1,start_iter=30"
run_ranks 4 sh-dp4 "${TUNED[@]}" --arms "demo-peer:topk=4"  # the DeMo port at our defaults' top-k
# the local-step arm and its Muon version on the second text, the same grid for both
LOCAL_GRID="lr=1x,2x,4x,8x;outer_lr=0.7,1"
run ca-a "${TUNED[@]}" --corpus "$CORPUS" --arms adamw
run ca-mu --preset smoke --seeds 0,1 --sweep "$LOCAL_GRID" --corpus "$CORPUS" --arms "$LOCAL,inner=muon"
run ca-l4 --preset smoke --seeds 0,1 --sweep "$LOCAL_GRID" --corpus "$CORPUS" --arms "$LOCAL"
run sh-clip "${TUNED[@]}" --grad-clip 1 --arms "adamw,$UNIFORM"
run ca-clip "${TUNED[@]}" --grad-clip 1 --corpus "$CORPUS" --arms "adamw,$UNIFORM"
run ca-u "${TUNED[@]}" --corpus "$CORPUS" --arms "$UNIFORM"  # ca-clip's unclipped pair, same machine
# clipping on top of the best >= 1000x recipe (its unclipped pairs: sh-wu3, ca-wu3)
run sh-clip-wu3 "${TUNED[@]}" --grad-clip 1 --arms "$WARM3"
run ca-clip-wu3 "${TUNED[@]}" --grad-clip 1 --corpus "$CORPUS" --arms "$WARM3"
"$PY" -m experiments.frontier "$OUT/sh-p" "$OUT/sh-u" "$OUT/sh-t3" "$OUT/sh-l" "$OUT/sh-wu" "$OUT/sh-wu2" "$OUT/sh-wu3" --out "$OUT/frontier-tuned-sh" --force
"$PY" -m experiments.frontier "$OUT/ca-p" "$OUT/ca-t3" "$OUT/ca-l" "$OUT/ca-wu" "$OUT/ca-wu3" --out "$OUT/frontier-tuned-ca" --force
