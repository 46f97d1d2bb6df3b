"""One rank of a docs example: ``python tests/_example_rank.py OUTDIR '["EXAMPLE"]'`` (the arguments
tests/comm/test_torch_backend.py's ``launch`` gives its worker, with the example as the one job).

The example runs as it is (``runpy``, as ``__main__``); around it this records, for the test:
every step of each distro-opt optimizer (a global step pre-hook: a checksum of its gradients then;
the parameters before its first step), what the process wrote in all (``wchar`` of /proc/self/io:
the sockets' bytes included), the distro-opt warnings, and at the end each optimizer's counters and
parameters, and the example's ``PHASES`` if it defines one (test-only scripts). Saved to
OUTDIR/rank{RANK}.pt as ``{"example": result}``, the layout ``launch`` reads. The process then ends
through ``process_group.end_process``, not the interpreter's finalization.

The launcher sets RANK, WORLD_SIZE and DISTRO_OPT_RENDEZVOUS_FILE, as for every multi-process test
here: the example's (or accelerate's) call of ``torch.distributed.init_process_group`` meets the
other ranks through that file instead of torch's TCP store (``experiments.process_group``).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import runpy
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distro_opt.experiments.process_group import end_process, remove_rendezvous_file, start_process_group
from distro_opt.optimizer import DecoupledMomentumOptimizer
from distro_opt.shards import local


def read_wchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


def digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def main() -> None:
    outdir, (example,) = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    # torchrun sets LOCAL_WORLD_SIZE too; accelerate reads it to tell one machine from several
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    joined = []
    original_init = dist.init_process_group

    def init_through_file(backend=None, *args, **kwargs):
        dist.init_process_group = original_init
        joined.append(start_process_group(backend or "gloo", datetime.timedelta(seconds=60)))

    dist.init_process_group = init_through_file
    steps, starts = {}, {}  # optimizer -> gradient checksums, one per step; its parameters before them

    def record_step(opt, args, kwargs):
        if isinstance(opt, DecoupledMomentumOptimizer):
            grads = [local(p.grad) for p in params_of(opt) if p.grad is not None]
            steps.setdefault(opt, []).append(digest(grads))
            starts.setdefault(opt, [local(p).detach().clone() for p in params_of(opt)])

    register_optimizer_step_pre_hook(record_step)
    rank = int(os.environ.get("RANK", "0"))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wchar0 = read_wchar()
            scope = runpy.run_path(example, run_name="__main__")
            wchar = read_wchar() - wchar0
        result = {
            "rank": rank,
            "wchar": wchar,
            "warnings": [str(w.message) for w in caught if str(w.message).startswith("distro-opt")],
            "phases": scope.get("PHASES"),
            "optimizers": [
                {
                    "grads": grads,
                    "comm": type(opt.comm).__name__,
                    "world_size": opt.comm.world_size,
                    "sent": opt.comm.stats.bytes_sent,
                    "received": opt.comm.stats.bytes_received,
                    "collectives": opt.comm.stats.steps,
                    "check_sent": opt.replica_check_stats.bytes_sent,
                    "checks": opt.replica_check_stats.steps,
                    "payload_nbytes": opt.payload_nbytes,
                    "n_params": sum(local(p).numel() for p in params_of(opt)),
                    "start": starts[opt],
                    "params": [local(p).detach().clone() for p in params_of(opt)],
                }
                for opt, grads in steps.items()
            ],
        }
        torch.save({"example": result}, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        for file in joined:
            remove_rendezvous_file(file)


if __name__ == "__main__":
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # not through the interpreter's finalization, where a Gloo rank can abort after its work is done
    # (end_process); a failed rank leaves its group as it is, as a peer may be gone
    end_process(code, None, destroy_group=code == 0)
