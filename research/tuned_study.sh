#!/usr/bin/env bash
# The tuned comparison behind docs/results-tuned.md: every arm at the same four learning rates
# (local steps also at two outer lrs), seeds 0 and 1, on Shakespeare and on three Canterbury-corpus
# texts; each arm at its best point against AdamW at its best. Then the two tuned frontiers.
# About two hours on 2 CPU cores; finished runs are skipped and interrupted ones resume.
#
#   bash research/tuned_study.sh [OUT]      # OUT defaults to runs/study
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/study}
mkdir -p "$OUT"
. research/_common.sh
GRID="lr=2x,4x,8x"  # sh-p: lr=1x,2x,4x,8x (1x was the worst point of every arm there)
SPLIT="distro:embed.topk=8,matrix.topk=2,decay=0.9"   # per-kind top-k (1,031x)
UNIFORM="distro:topk=3,decay=0.9"                     # the same idea for every parameter (1,135x)
TOP3="distro:topk=3"                                  # top-3 alone (1,135x)
LOCAL="distro:sync_every=16,topk=12,bits=2,embed.topk=31,matrix.topk=6"  # local steps (5,751x)
CORPUS="$OUT/corpus-canterbury"
canterbury_corpus "$CORPUS"
TUNED=(--preset smoke --seeds 0,1 --sweep "$GRID")
run sh-p --preset smoke --seeds 0,1 --sweep "lr=1x,2x,4x,8x" --arms "adamw,distro,$SPLIT"
run sh-u "${TUNED[@]}" --arms "$UNIFORM"
run ca-p "${TUNED[@]}" --corpus "$CORPUS" --arms "adamw,distro,$UNIFORM"
run sh-t3 "${TUNED[@]}" --arms "$TOP3"
run ca-t3 "${TUNED[@]}" --corpus "$CORPUS" --arms "$TOP3"
run sh-l --preset smoke --seeds 0,1 --sweep "$GRID;outer_lr=0.7,1" --arms "$LOCAL"
run ca-l --preset smoke --seeds 0,1 --sweep "$GRID;outer_lr=0.7,1" --corpus "$CORPUS" --arms "$LOCAL"
"$PY" -m experiments.frontier "$OUT/sh-p" "$OUT/sh-u" "$OUT/sh-t3" "$OUT/sh-l" --out "$OUT/frontier-tuned-sh" --force
"$PY" -m experiments.frontier "$OUT/ca-p" "$OUT/ca-t3" "$OUT/ca-l" --out "$OUT/frontier-tuned-ca" --force
