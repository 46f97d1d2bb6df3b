#!/usr/bin/env bash
# Issue 6's parity study, end to end: every run behind docs/results-parity.md's tables, then the
# frontier tables and plots. Hours of CPU on a 2-core machine (the parity-preset runs take 15-20 min
# per arm and seed). Runs that already finished are skipped; an interrupted one resumes.
#
#   bash research/parity_study.sh [OUT]      # OUT defaults to runs/study
#
# Needs the set-up of the README (scripts/setup.sh, python -m experiments.prepare) and, for the
# second corpus, network access to PyPI once (pip download of the brotli sdist, whose test data
# holds three Canterbury-corpus texts: Alice in Wonderland, Paradise Lost, a technical lecture).
# Its results were measured with DeMo's sign rule as DisTrOAdamW's default: to rerun a per-step distro
# arm as measured, add update=sign to it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/study}
LOCAL="distro:sync_every=8,topk=64,bits=2"
mkdir -p "$OUT"
. research/_common.sh

# 1. Tokens per worker-step at a fixed budget (4 workers x 4,800 sequences of 128 tokens each).
run tok-b4 --preset smoke --batch-size 4 --steps 1200 --warmup-steps 120 --eval-every 100 --arms "adamw,distro,$LOCAL"
run tok-b16 --preset smoke --batch-size 16 --steps 300 --warmup-steps 30 --eval-every 50 --arms "adamw,distro,$LOCAL"
run tok-b64 --preset smoke --batch-size 64 --steps 75 --warmup-steps 8 --eval-every 25 --arms "adamw,distro,$LOCAL"
run tok-b64-seed1 --preset smoke --batch-size 64 --steps 75 --warmup-steps 8 --eval-every 25 --seeds 1 --arms "adamw,distro,$LOCAL"
# 2. Local steps at >= 5000x less traffic than a dense bf16 gradient (tok-b16's settings).
B16="--preset smoke --batch-size 16 --steps 300 --warmup-steps 30 --eval-every 50"
DENSE="topk=4096,bits=32"  # every coefficient at 32 bits: nothing compressed
H16="distro:sync_every=16,topk=12,bits=2"
H32="distro:sync_every=32,topk=24,bits=2"
run tok-b16-5k $B16 --arms "adamw,$H16,$H32"
run tok-b16-5k-h8 $B16 --arms "distro:sync_every=8,topk=6,bits=2"
run tok-b16-5k-olr2 $B16 --arms "$H32,outer_lr=2"
# More of the same bytes to the embedding (per-kind top-k), and the other way.
run tok-b16-5k-split $B16 --arms "$H16,embed.topk=24,matrix.topk=8"
run tok-b16-5k-split-seed1 $B16 --seeds 1 --arms "adamw,$H16,$H16,embed.topk=24,matrix.topk=8"
run tok-b16-5k-split-more $B16 \
    --arms "$H16,embed.topk=31,matrix.topk=6,distro:sync_every=8,topk=6,bits=2,embed.topk=12,matrix.topk=4"
run tok-b16-5k-split38 $B16 --arms "$H16,embed.topk=38,matrix.topk=4"
run tok-b16-5k-split38-seed1 $B16 --seeds 1 --arms "$H16,embed.topk=38,matrix.topk=4"
run tok-b16-5k-split-more-seed1 $B16 --seeds 1 --arms "$H16,embed.topk=31,matrix.topk=6"
run tok-b16-5k-starve $B16 --arms "$H16,embed.topk=1,matrix.topk=15"
run tok-b16-5k-split32 $B16 --arms "$H32,embed.topk=48,matrix.topk=16"
run tok-b16-5k-split32-seed1 $B16 --seeds 1 --arms "$H32,$H32,embed.topk=48,matrix.topk=16"
# The floor of local steps: every coefficient at 32 bits (plain periodic averaging), per H.
run tok-b16-dense-local $B16 \
    --arms "distro:sync_every=16,$DENSE,distro:sync_every=8,$DENSE,distro:sync_every=32,$DENSE"
run tok-b16-dense-local-short $B16 --arms "distro:sync_every=2,$DENSE,distro:sync_every=4,$DENSE"
# One worker alone (a quarter of the tokens): the bar a distributed run has to clear.
run tok-b16-one-worker $B16 --workers 1 --arms adamw
run smoke-one-worker --preset smoke --workers 1 --arms adamw
run tok-b16-one-worker-seed1 $B16 --seeds 1 --workers 1 --arms adamw
run tok-b16-dense-local-seed1 $B16 --seeds 1 --arms "distro:sync_every=16,$DENSE"
# The outer step: DiLoCo's Nesterov, longer and shorter steps, with and without compression.
run tok-b16-nesterov $B16 --arms "distro:sync_every=16,$DENSE,outer_lr=0.7,outer_momentum=0.9,$H16,embed.topk=31,matrix.topk=6,outer_lr=0.7,outer_momentum=0.9"
run tok-b16-outer-lr $B16 --arms "distro:sync_every=16,$DENSE,outer_lr=2,$H16,embed.topk=31,matrix.topk=6,outer_lr=1.5"
run tok-b16-outer-lr-half $B16 --arms "distro:sync_every=16,$DENSE,outer_lr=0.5"
# A prototype outside the library: rank-r factors of the pseudo-gradient instead of DCT top-k.
for spec in "1 4" "2 2"; do  # rank, bits per factor value
    read -r rank bits <<<"$spec"
    f="$OUT/lowrank-r$rank-b$bits.jsonl"
    [ -f "$f" ] || "$PY" research/lowrank_prototype.py --sync-every 16 --rank "$rank" --bits "$bits" --out "$f"
done
# Worker data: every worker draws from the whole text (iid) instead of its own quarter.
run iid-smoke --preset smoke --sharding iid --arms "adamw,distro,$LOCAL"
run iid-b16-5k $B16 --sharding iid --arms "adamw,$H16,$H16,embed.topk=31,matrix.topk=6"
# 3. Knobs of the per-step mode at the same bytes (smoke preset, 300 steps).
run knobs --preset smoke \
    --arms "adamw,distro,distro:decay=0.99,distro:decay=0.9,distro:decay=0.8,distro:decay=0.5,distro:decay=0.0,distro:embed.update=adam"
run sweep --preset smoke --eval-batches 8 \
    --arms "adamw,distro,distro:update=adam,distro:lr=0.0003,demo,$LOCAL,distro:sync_every=32,topk=128,bits=2"
run smoke-b32 --preset smoke --batch-size 32 --arms "adamw,distro,$LOCAL"
run smoke-split --preset smoke --arms "distro:embed.topk=7,matrix.topk=3,distro:embed.topk=8,matrix.topk=2"
# Nothing compressed (every coefficient, 32 bits): how far is the sign update itself from AdamW, and
# does the Adam update then match AdamW?
run decomp --preset smoke --arms "adamw,distro:$DENSE,distro:update=adam,$DENSE"
# The rms update (U / rms(U) per tensor) against the sign update, at 1x and 2x lr.
run update-rms --preset smoke --arms "adamw,distro:update=rms,distro:update=rms,lr=0.002"
run smoke-sign-lr2 --preset smoke --arms "distro:lr=0.002"
run update-rms-seed1 --preset smoke --seeds 1 \
    --arms "adamw,distro,distro:lr=0.002,distro:update=rms,distro:update=rms,lr=0.002"
# 4. The parity preset (3000 steps): defaults and the sign step at lr 2e-3 on two seeds; single-seed
#    checks of local steps, a lower lr and a lower compression decay.
run parity --preset parity --arms "adamw,distro"
run parity-local --preset parity --seeds 0 --arms "$LOCAL"
run parity-lr --preset parity --arms "distro:lr=0.002"
run parity-lr-high --preset parity --seeds 0 --arms "distro:lr=0.004"
run parity-lr-low --preset parity --seeds 0 --arms "distro:lr=0.0003"
run parity-decay --preset parity --seeds 0 --arms "distro:decay=0.9"
run parity-rms --preset parity --arms "distro:update=rms,lr=0.002"
run parity-5k --preset parity --seeds 0 --arms "$H16"
run parity-5k-split --preset parity --seeds 0 --arms "$H16,embed.topk=31,matrix.topk=6"
run parity-one-worker --preset parity --seeds 0 --workers 1 --arms adamw
run parity-one-worker-seed1 --preset parity --seeds 1 --workers 1 --arms adamw
# 5. Text the study never saw: three Canterbury-corpus texts (Shakespeare's asyoulik.txt left out).
CORPUS="$OUT/corpus-canterbury"
canterbury_corpus "$CORPUS"
run canterbury-b4 --preset smoke --corpus "$CORPUS" --arms "adamw,distro,$LOCAL"
# 6. Model width at the smoke preset's settings (scale-d128 is the smoke model itself): does the gap
#    shrink as the model grows?
run scale-d64 --preset smoke --d-model 64 --d-ff 192 --arms "adamw,distro,$LOCAL"
run scale-d128 --preset smoke --arms "adamw,distro,$LOCAL"
run scale-d256 --preset smoke --d-model 256 --d-ff 768 --arms "adamw,distro,$LOCAL"
# 7. The frontiers: gap vs compression (and vs tokens per worker-step for the tok-* runs).
"$PY" -m experiments.frontier "$OUT"/tok-b4 "$OUT"/tok-b16 "$OUT"/tok-b64 "$OUT"/tok-b64-seed1 "$OUT"/tok-b16-5k \
    "$OUT"/tok-b16-5k-h8 "$OUT"/tok-b16-5k-olr2 "$OUT"/tok-b16-5k-split "$OUT"/tok-b16-5k-split-seed1 \
    "$OUT"/tok-b16-5k-split-more "$OUT"/tok-b16-5k-split38 "$OUT"/tok-b16-5k-starve "$OUT"/tok-b16-5k-split32 \
    "$OUT"/tok-b16-5k-split32-seed1 "$OUT"/tok-b16-5k-split38-seed1 "$OUT"/tok-b16-5k-split-more-seed1 \
    "$OUT"/tok-b16-dense-local "$OUT"/tok-b16-dense-local-short "$OUT"/tok-b16-outer-lr "$OUT"/tok-b16-outer-lr-half \
    --out "$OUT/frontier-tokens" --force
"$PY" -m experiments.frontier "$OUT"/parity "$OUT"/parity-local "$OUT"/parity-lr "$OUT"/parity-rms "$OUT"/parity-5k \
    "$OUT"/parity-5k-split "$OUT"/knobs \
    "$OUT"/sweep "$OUT"/decomp "$OUT"/update-rms "$OUT"/smoke-sign-lr2 \
    "$OUT"/smoke-b32 "$OUT"/smoke-split "$OUT"/tok-b16-5k "$OUT"/canterbury-b4 \
    --out "$OUT/frontier" --force
