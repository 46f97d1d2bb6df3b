#!/usr/bin/env bash
# GPU/NCCL check of distro-opt on a machine with CUDA GPUs (CI has none; run this by hand there).
#
#   bash scripts/gpu_check.sh            # from the repository root, with the package installed
#   PYTHON=/path/to/python PYTEST=/path/to/pytest bash scripts/gpu_check.sh
#
# 1. environment: torch, CUDA, NCCL versions, GPU count
# 2. the training example at world size 1 over NCCL (fp32, then bf16 + autocast + overlap)
# 3. the tests marked nccl (tests/comm/test_torch_backend.py, world size min(2, GPUs)) or cuda
#    (tests/unit/test_cuda.py: GPU against CPU results, checkpoints moved between them)
# 4. the optimizer step time on GPU 0 (benchmarks/bench_step.py) for the 5M and the 1.2B shapes
#    (the 1.2B one needs ~80 GB of GPU memory; BENCH_1B=0 skips it)
# Every command has a time limit; the script stops at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
# pytest's own launcher, not "python -m pytest": the latter puts the repository root on sys.path,
# where comm/ would shadow Jupyter's top-level "comm" package.
PYTEST=${PYTEST:-$( [ -x .venv/bin/pytest ] && echo .venv/bin/pytest || echo pytest )}
export MASTER_ADDR=127.0.0.1 OMP_NUM_THREADS=1

echo "== environment"
"$PYTHON" - <<'PY'
import torch
print("torch", torch.__version__, "| cuda available", torch.cuda.is_available(),
      "| GPUs", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0), "| NCCL", torch.cuda.nccl.version())
else:
    raise SystemExit("no CUDA GPU visible: nothing to check here")
PY

run_example() {
    echo "== torchrun --nproc-per-node 1 -m experiments.train_ddp $*"
    timeout 300 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
        -m experiments.train_ddp --device cuda --steps 20 "$@"
}
run_example
run_example --dtype bfloat16 --autocast --overlap

echo "== NCCL and CUDA tests"
timeout 600 "$PYTEST" tests/comm/test_torch_backend.py tests/unit/test_cuda.py -m "nccl or cuda" -q -rs -p no:cacheprovider

echo "== optimizer step time on the GPU"
timeout 300 "$PYTHON" benchmarks/bench_step.py --device cuda --model 5m --steps 20 --rounds 5
if [ "${BENCH_1B:-1}" != 0 ]; then
    timeout 600 "$PYTHON" benchmarks/bench_step.py --device cuda --model 1.2b --steps 10 --rounds 5
fi
echo "== gpu_check: all passed"
