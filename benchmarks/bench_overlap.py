"""Overlap vs blocking communication: time per step and loss after a fixed number of steps.

Two real Gloo processes on 127.0.0.1 train the MLP of ``experiments/train_ddp.py`` with DisTrOAdamW,
once blocking (``overlap=False``: each step waits for its all-gather) and once overlapped
(``overlap=True``: step t's all-gather travels while step t+1 computes, and its update lands one
step late). Loopback has almost no latency, so each arm also runs behind a simulated slow link:
every collective takes at least ``latency`` seconds from its start (a wrapper sleeps in ``wait()``
until then). Blocking pays the latency every step; overlap hides it behind the next step's compute.

    python benchmarks/bench_overlap.py [--steps 40] [--lr 0.01 0.003] [--latency-ms 0 20] [--hidden 256]

Prints a markdown table: mean step time (first steps excluded) and the held-out loss at the end.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distro_opt.cli_args import at_least
from distro_opt.comm import Backend, PendingGather
from distro_opt.experiments.process_group import one_machine_env

WARMUP_STEPS = 3


class SlowLink(Backend):
    """A ``Backend`` wrapper whose collectives complete no sooner than ``latency_s`` after they start.

    Only the waiting is simulated; the bytes still travel through the wrapped backend, whose
    ``stats`` are reported unchanged.
    """

    def __init__(self, inner, latency_s: float):
        self.inner, self.latency_s = inner, latency_s
        self.rank, self.world_size, self.stats = inner.rank, inner.world_size, inner.stats

    def start_all_gather(self, buf):
        ready_at = time.perf_counter() + self.latency_s
        pending = self.inner.start_all_gather(buf)

        def wait():
            result = pending.wait()
            time.sleep(max(0.0, ready_at - time.perf_counter()))
            return result

        return PendingGather(wait)

    def all_gather(self, buf):
        return self.start_all_gather(buf).wait()

    def all_reduce(self, tensor, op="mean"):
        ready_at = time.perf_counter() + self.latency_s
        self.inner.all_reduce(tensor, op)
        time.sleep(max(0.0, ready_at - time.perf_counter()))
        return tensor

    def close(self):
        self.inner.close()


def worker(args) -> None:
    """One rank: run every (lr, latency, overlap) arm in turn, save the results as JSON."""
    import torch
    import torch.distributed as dist

    from distro_opt.comm.torch_backend import TorchDistributedBackend
    from distro_opt.experiments.process_group import start_process_group
    from distro_opt.experiments.train_ddp import TrainConfig, train

    torch.set_num_threads(1)
    start_process_group("gloo", datetime.timedelta(seconds=120))
    rows = []
    arms = [(lr, lat, ov) for lr in args.lr for lat in args.latency_ms for ov in (False, True)]
    for lr, latency_ms, overlap in arms:
        cfg = TrainConfig(steps=args.steps, hidden=args.hidden, batch_size=args.batch_size,
                          in_features=args.hidden // 4, lr=lr, overlap=overlap, log=False)
        comm = SlowLink(TorchDistributedBackend(timeout_s=60), latency_ms / 1000)
        comm.inner.barrier()  # start both ranks' clocks together
        result = train(cfg, comm)
        rows.append({
            "lr": lr, "latency_ms": latency_ms, "overlap": overlap,
            "step_s": statistics.mean(result["step_s"][WARMUP_STEPS:]),
            "comm_wait_s": statistics.mean(result["comm_s"][WARMUP_STEPS:]),
            "eval_loss": result["eval_loss"], "eval_loss_start": result["eval_loss_start"],
            "bytes_per_step": result["bytes_sent"] / args.steps,
        })
    Path(args.out).joinpath(f"rank{dist.get_rank()}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def launch(args) -> list[list[dict]]:
    """Start 2 ranks of this script on 127.0.0.1 with a bounded wait; return their rows."""
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, __file__, "--worker", "--out", out, "--steps", str(args.steps),
                "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
                "--latency-ms", *map(str, args.latency_ms), "--lr", *map(str, args.lr)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen(argv, env={**env, **one_machine_env(r, 2, f"{out}/rendezvous")})
                 for r in range(2)]
        try:
            for p in procs:
                if p.wait(timeout=args.timeout_s) != 0:
                    sys.exit(f"a rank failed with exit code {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def table(ranks: list[list[dict]]) -> str:
    lines = [
        "| lr | added latency per collective | mode | mean step time (ms), rank 0 / rank 1 | comm wait (ms) "
        "| held-out loss after training (start) | bytes sent per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r0, r1 in zip(*ranks):
        mode = "overlap (update 1 step late)" if r0["overlap"] else "blocking"
        lines.append(
            f"| {r0['lr']:g} | {r0['latency_ms']:g} ms | {mode} "
            f"| {1e3 * r0['step_s']:.1f} / {1e3 * r1['step_s']:.1f} "
            f"| {1e3 * r0['comm_wait_s']:.1f} | {r0['eval_loss']:.4f} ({r0['eval_loss_start']:.4f}) "
            f"| {r0['bytes_per_step']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=at_least(int, WARMUP_STEPS + 1), default=40,
                        help=f"steps per run, the first {WARMUP_STEPS} untimed (default 40)")
    parser.add_argument("--latency-ms", type=at_least(float, 0.0), nargs="+", default=[0.0, 20.0])
    parser.add_argument("--lr", type=at_least(float, 0.0, exclusive=True), nargs="+", default=[1e-2, 3e-3])
    parser.add_argument("--hidden", type=at_least(int, 1), default=256)
    parser.add_argument("--batch-size", type=at_least(int, 1), default=256)
    parser.add_argument("--timeout-s", type=at_least(float, 0.0, exclusive=True), default=300.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    ranks = launch(args)
    print(f"2 Gloo ranks on 127.0.0.1, {args.steps} steps, MLP hidden {args.hidden}, "
          f"batch {args.batch_size}, "
          f"DisTrOAdamW defaults; step times exclude the first {WARMUP_STEPS} steps\n")
    print(table(ranks))


if __name__ == "__main__":
    main()
