"""What Gloo sends beyond the bytes it is given: all-gathers and a one-number all-reduce over the lab.

    sudo .venv/bin/python research/gloo_framing.py [--workers 4] [--ops 200] [--sizes 2700,20000]

One process per namespace of the network lab (1 Gbit/s links), torch.distributed over Gloo. Each
runs ``--ops`` all-gathers of a buffer of each size, then ``--ops`` all-reduces of one float64 (the
runner's train-loss mean), between two barriers; the kernel's counters are read around them. Per
operation and rank it prints the TCP payload the kernel carried (``netlab.tcp_payload_bytes``: its
bytes less one header per packet) and, for the all-gathers, what a backend counts ((N - 1) x size):
the difference is Gloo's own framing, which no backend can see. ``research/netlab_study.py``'s byte
columns are read with it (docs/netlab.md).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments.netlab import Lab, tcp_payload_bytes  # noqa: E402


def worker(kind: str, nbytes: int, ops: int) -> None:
    """One rank: wait for a line on stdin, run the operations, say "done", wait, leave."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    buf, out = torch.zeros(nbytes, dtype=torch.uint8), torch.empty(n * nbytes, dtype=torch.uint8)
    dist.barrier()
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(ops):
        if kind == "all_gather":
            dist.all_gather_into_tensor(out, buf)
        else:
            dist.all_reduce(torch.zeros(1, dtype=torch.float64))
    dist.barrier()
    print("done", flush=True)
    sys.stdin.readline()
    dist.destroy_process_group()


def measure(lab: Lab, kind: str, nbytes: int, ops: int, port: int, timeout_s: float = 120) -> list[float]:
    """Per rank, the kernel's TCP payload per operation (the barriers' few bytes included)."""
    procs = []
    for p in lab.peers:
        env = {**os.environ, "RANK": str(p.index), "WORLD_SIZE": str(lab.n), "MASTER_ADDR": lab.peers[0].address,
               "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "eth0", "PYTHONWARNINGS": "ignore"}
        argv = [sys.executable, __file__, "--worker", kind, str(nbytes), str(ops)]
        procs.append(lab.popen(p.index, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True))

    def step(expected: str) -> None:
        for proc in procs:
            line = proc.stdout.readline().strip()  # bounded: the lab's run ends with the timeout below
            if line != expected:
                raise RuntimeError(f"a rank said {line!r}, not {expected!r} (exit code {proc.poll()})")

    step("ready")
    before = [lab.counters(i) for i in range(lab.n)]
    for proc in procs:
        proc.stdin.write("\n")
        proc.stdin.flush()
    step("done")
    after = [lab.counters(i) for i in range(lab.n)]
    for proc in procs:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=timeout_s)
    return [tcp_payload_bytes({k: a[k] - b[k] for k in a}) / ops for a, b in zip(after, before)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--sizes", default="2700,20000", help="all-gather buffer sizes in bytes, comma-separated")
    ap.add_argument("--worker", nargs=3, metavar=("KIND", "BYTES", "OPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return 0
    if args.workers < 2 or args.ops < 1:
        ap.error("--workers must be at least 2 and --ops at least 1")
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"| operation ({args.workers} ranks, {args.ops} each) | backend counts per rank | kernel TCP payload "
          "per rank | Gloo's framing per rank |\n|---|---|---|---|")
    with Lab(n=args.workers, rate_mbit=1000) as lab:
        port = 29600
        for kind, nbytes in [("all_gather", s) for s in sizes] + [("all_reduce", 8)]:
            port += 1
            payload = measure(lab, kind, nbytes, args.ops, port)
            counted = (args.workers - 1) * nbytes if kind == "all_gather" else 0
            print(f"| {kind} of {nbytes} B | {counted} | {min(payload):.0f}-{max(payload):.0f} | "
                  f"{min(payload) - counted:.0f}-{max(payload) - counted:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
