"""Latency of one step's gather on loopback: HivemindBackend vs TorchDistributedBackend (Gloo).

The payload is the one DisTrOAdamW (default compression) sends for the ``smoke`` preset's model,
so both backends move exactly what a training step would. Each peer is its own process (a hivemind
peer also brings its DHT process and p2p daemon), everything binds to 127.0.0.1. Each peer times
``all_gather`` over ``--steps`` steps after ``--warmup`` steps; the table gives the median and 90th
percentile over all peers and steps, and the bytes one peer sent and received per step (as counted
by the backend's ``CommStats``: for hivemind, everything that crossed its streams, framing and
votes included).

    python benchmarks/bench_gather.py [--peers 2 4 8] [--steps 30] [--backends hivemind torch]
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
from distro_opt.experiments.presets import PRESETS

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def payload_nbytes(preset: str) -> tuple[int, int]:
    from distro_opt import DisTrOAdamW
    from distro_opt.experiments.model import build_model
    from distro_opt.experiments.presets import get_preset

    model = build_model(get_preset(preset).model_config(), seed=0)
    return DisTrOAdamW(model.parameters()).payload_nbytes, sum(p.numel() for p in model.parameters())


def timed_gathers(backend, nbytes: int, rank: int, warmup: int, steps: int) -> dict:
    import torch

    buf = torch.full((nbytes,), rank % 256, dtype=torch.uint8)
    times, sizes = [], []
    for i in range(warmup + steps):
        sent0, recv0 = backend.stats.bytes_sent, backend.stats.bytes_received
        t0 = time.perf_counter()
        out = backend.all_gather(buf)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            sizes.append((backend.stats.bytes_sent - sent0, backend.stats.bytes_received - recv0, len(out)))
    return {"times": times, "sizes": sizes}


def wait_for_file(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not written within {timeout_s} s")
        time.sleep(0.1)
    return path.read_text()


def hivemind_worker(args) -> dict:
    from distro_opt.comm.hivemind_backend import HivemindBackend

    initial = wait_for_file(Path(args.addr_file), 120).split() if args.rank else []
    backend = HivemindBackend(
        "bench",
        initial_peers=initial,
        host_maddrs=[LOOPBACK],
        step_timeout_s=30.0,
        heartbeat_s=1.0,
        ttl_s=10.0,
    )
    if args.rank == 0:
        Path(args.addr_file + ".tmp").write_text("\n".join(backend.visible_maddrs))
        os.replace(args.addr_file + ".tmp", args.addr_file)
    try:
        backend.wait_for_peers(args.world - 1, 120)
        time.sleep(1.5)  # let every peer's view settle: all active peers are expected from step 0
        return timed_gathers(backend, args.nbytes, args.rank, args.warmup, args.steps)
    finally:
        backend.close()


def torch_worker(args) -> dict:
    import torch.distributed as dist

    from distro_opt.comm.torch_backend import TorchDistributedBackend
    from distro_opt.experiments.process_group import start_process_group

    start_process_group("gloo", datetime.timedelta(seconds=60))
    try:
        return timed_gathers(
            TorchDistributedBackend(timeout_s=60), args.nbytes, args.rank, args.warmup, args.steps
        )
    finally:
        dist.destroy_process_group()


def run(backend: str, world: int, nbytes: int, warmup: int, steps: int, timeout_s: float) -> list[dict]:
    from distro_opt.experiments.process_group import one_machine_env

    with tempfile.TemporaryDirectory() as tmp:
        common = [
            sys.executable,
            __file__,
            "--worker",
            backend,
            "--world",
            str(world),
            "--nbytes",
            str(nbytes),
            "--warmup",
            str(warmup),
            "--steps",
            str(steps),
            "--addr-file",
            f"{tmp}/addr",
        ]
        env = dict(os.environ, HIVEMIND_LOGLEVEL="ERROR", OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                common + ["--rank", str(r), "--out", f"{tmp}/r{r}.json"],
                env={**env, **one_machine_env(r, world, f"{tmp}/rendezvous")},  # used by the torch workers
                start_new_session=True,
                cwd=tmp,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                    raise RuntimeError(f"{backend} worker failed (exit {p.returncode})")
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
        return [json.loads(Path(f"{tmp}/r{r}.json").read_text()) for r in range(world)]


def summarize(results: list[dict]) -> dict:
    times = sorted(t for r in results for t in r["times"])
    sizes = [s for r in results for s in r["sizes"]]
    return {
        "median_ms": 1e3 * statistics.median(times),
        "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
        "sent": statistics.median(s[0] for s in sizes),
        "received": statistics.median(s[1] for s in sizes),
        "contributors": min(s[2] for s in sizes),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=at_least(int, 1), nargs="+", default=[2, 4, 8])
    p.add_argument("--backends", nargs="+", default=["hivemind", "torch"], choices=["hivemind", "torch"])
    p.add_argument("--preset", default="smoke", choices=sorted(PRESETS))
    p.add_argument("--steps", type=at_least(int, 1), default=30)
    p.add_argument("--warmup", type=at_least(int, 0), default=5)
    p.add_argument("--timeout-s", type=at_least(float, 0.0, exclusive=True), default=300.0)
    p.add_argument("--worker", choices=["hivemind", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--addr-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = (hivemind_worker if args.worker == "hivemind" else torch_worker)(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    nbytes, nparams = payload_nbytes(args.preset)
    print(
        f"payload: {nbytes} bytes per peer and step (DisTrOAdamW defaults, preset {args.preset}, "
        f"{nparams / 1e6:.2f}M parameters, {nbytes / nparams:.4f} bytes/parameter)"
    )
    print(
        f"{'backend':<9} {'peers':>5} {'median ms':>10} {'p90 ms':>8} {'sent B/step':>12} {'recv B/step':>12}"
        f" {'gathered':>8}"
    )
    for world in args.peers:
        for backend in args.backends:
            s = summarize(run(backend, world, nbytes, args.warmup, args.steps, args.timeout_s))
            print(
                f"{backend:<9} {world:>5} {s['median_ms']:>10.1f} {s['p90_ms']:>8.1f} {s['sent']:>12.0f} "
                f"{s['received']:>12.0f} {s['contributors']:>8}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
