"""Time to loss over capped links: the runner's ranks, one process per namespace of the network lab.

    sudo .venv/bin/python research/netlab_study.py --out runs/netlab --rates 10,100 --steps 20

For each rate (every link capped at it, upload and download) and each arm, WORLD_SIZE processes of
``python -m experiments.run`` train the smoke preset over torch.distributed (Gloo, env:// with its
TCP store on peer 0), each in its own namespace. Then, per arm: validation loss against the
measured wall-clock, the time to a common target loss (the highest final loss among the arms), and
each rank's bytes (its backend's count) against its interface's kernel counters. Because the
processes share this machine's cores, a second time is modelled: each step's measured
communication time plus the compute time of one worker measured alone (a world of one), plus
rounds x RTT as a latency model (the lab adds no latency). Bytes, three ways, per rank: the
kernel's tx bytes over the backend's count; the kernel's TCP payload (its bytes less one header per
packet, ``netlab.tcp_payload_bytes``) over it; and the same for the steps alone (the difference to a
run of --marginal-steps steps at the last rate, so that what a run sends once cancels). Writes
study.json and study.md in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments.netlab import Lab, tcp_payload_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# ring collectives: an all-reduce is 2(N-1) rounds (reduce-scatter, all-gather), an all-gather N-1
ROUNDS = {"adamw": lambda n: 2 * (n - 1), "distro": lambda n: n - 1}  # by kind: the label before any ":"


def runner_argv(args, arm: str, out: Path, workers: int, steps: int | None = None) -> list[str]:
    return [sys.executable, "-m", "experiments.run", "--preset", "smoke", "--arms", arm, "--workers", str(workers),
            "--steps", str(steps or args.steps), "--warmup-steps", "2", "--eval-every", str(args.eval_every),
            "--checkpoint-every", str(10 * args.steps), "--out", str(out)]


def run_over_lab(lab: Lab, args, arm: str, out: Path, port: int, steps: int | None = None) -> dict:
    """One arm, one process per peer; returns each rank's kernel counter deltas and the elapsed s."""
    before = [lab.counters(p.index) for p in lab.peers]
    start, procs = time.monotonic(), []
    for p in lab.peers:
        env = {**os.environ, "RANK": str(p.index), "LOCAL_RANK": "0", "WORLD_SIZE": str(lab.n),
               "MASTER_ADDR": lab.peers[0].address, "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "eth0"}
        procs.append(lab.popen(p.index, runner_argv(args, arm, out, lab.n, steps), env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = [proc.communicate(timeout=args.timeout_s)[1] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"{arm} over the lab failed: {[e.strip()[-300:] for e in errors]}")
    after = [lab.counters(p.index) for p in lab.peers]
    deltas = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    return {"elapsed_s": time.monotonic() - start,
            "kernel_tx_bytes": [d["tx_bytes"] for d in deltas],
            "kernel_rx_bytes": [d["rx_bytes"] for d in deltas],
            "kernel_tx_payload": [tcp_payload_bytes(d) for d in deltas]}


def backend_sent(result: dict) -> list[int]:
    """Each rank's bytes sent as its backend counted them (the replica checks' included)."""
    return [w["sent"] + w["check_sent"] for w in result["workers"]]


def marginal(lab: Lab, args, arm: str, out: Path, port: int, full: dict) -> dict:
    """The bytes of the steps alone: the arm run again for --marginal-steps steps, and per rank
    (kernel TCP payload of the full run - of the short run) / (backend bytes of the full - short).
    Whatever a run sends once (rendezvous, Gloo's connections, the start checks, the results'
    gather) cancels; the training loss all-reduce of every step and the evaluations' remain."""
    short = run_over_lab(lab, args, arm, out, port, args.marginal_steps)
    backend = backend_sent(read_run(out, arm)[1])
    return {"steps": args.marginal_steps, "kernel_tx_payload": short["kernel_tx_payload"], "backend_sent_bytes": backend,
            "payload_over_backend": [(kf - ks) / (bf - bs) for kf, ks, bf, bs in zip(
                full["kernel_tx_payload"], short["kernel_tx_payload"], full["backend_sent_bytes"], backend)]}


def read_run(out: Path, arm: str) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["arm"] == arm], json.loads((out / "results" / f"{arm}-seed0.json").read_text())


def compute_alone(args, arm: str, out: Path) -> float:
    """Mean compute s per step of one worker training alone (a world of one, in process)."""
    subprocess.run(runner_argv(args, arm, out, 1), cwd=ROOT, check=True, capture_output=True, timeout=args.timeout_s)
    rows = [r for r in read_run(out, arm)[0] if r["step"] > 0]
    return sum(r["compute_s"] + r["codec_s"] for r in rows) / len(rows)


def curve(rows: list[dict], alone_s: float, rtt_s: float, rounds: int) -> list[dict]:
    """Per evaluated step: val loss, measured wall s, modelled s (alone compute + measured comm + RTTs)."""
    points, model_s = [], 0.0
    for r in rows:
        if r["step"] > 0:
            model_s += alone_s + r["comm_s"] + rounds * rtt_s
        if r["val_loss"] is not None:
            points.append({"step": r["step"], "val_loss": r["val_loss"], "wall_s": r["wall_s"], "model_s": model_s})
    return points


def time_to(points: list[dict], target: float, key: str) -> float | None:
    return next((p[key] for p in points if p["val_loss"] <= target), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rates", default="10,100", help="Mbit/s, comma-separated")
    ap.add_argument("--arms", default="adamw,distro")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--rtt-ms", type=float, default=50.0, help="RTT of the latency model")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--marginal-steps", type=int, default=None,
                    help="at the last rate, also run each arm this many steps, to compare the bytes of the "
                         "steps alone (default: half of --steps; 0: skip)")
    ap.add_argument("--table", action="store_true", help="only rewrite --out's study.md from its study.json")
    args = ap.parse_args()
    if args.table:
        study = json.loads((args.out / "study.json").read_text())
        (args.out / "study.md").write_text(table(study))
        print(table(study))
        return 0
    if args.marginal_steps is None:
        args.marginal_steps = args.steps // 2
    if not 0 <= args.marginal_steps < args.steps:
        ap.error(f"--marginal-steps {args.marginal_steps}: expected 0 to {args.steps - 1} (fewer than --steps)")
    if args.out.exists():
        print(f"error: --out {args.out} exists (never overwritten; --table rewrites its study.md)", file=sys.stderr)
        return 2
    arms, rates = args.arms.split(","), [float(r) for r in args.rates.split(",")]
    alone = {arm: compute_alone(args, arm, args.out / "alone" / arm) for arm in arms}
    study = {"workers": args.workers, "steps": args.steps, "rtt_ms": args.rtt_ms, "compute_alone_s": alone, "rates": {}}
    port = 29400
    for rate in rates:
        per_arm = {}
        with Lab(n=args.workers, rate_mbit=rate) as lab:
            for arm in arms:
                port += 1
                out = args.out / f"{rate:g}mbit" / arm
                lab_run = run_over_lab(lab, args, arm, out, port)
                rows, result = read_run(out, arm)
                backend = backend_sent(result)
                per_arm[arm] = {**lab_run, "backend_sent_bytes": backend,
                                "kernel_over_backend": [k / b for k, b in zip(lab_run["kernel_tx_bytes"], backend)],
                                "payload_over_backend": [k / b for k, b in zip(lab_run["kernel_tx_payload"], backend)],
                                "curve": curve(rows, alone[arm], args.rtt_ms / 1e3, ROUNDS[arm.split(":")[0]](args.workers)),
                                "comm_s": sum(r["comm_s"] for r in rows)}
                print(json.dumps({"rate_mbit": rate, "arm": arm, "elapsed_s": round(lab_run["elapsed_s"], 1),
                                  "kernel_over_backend": [round(x, 4) for x in per_arm[arm]["kernel_over_backend"]]}),
                      flush=True)
            if rate == rates[-1] and args.marginal_steps:  # bytes do not depend on the rate: once
                for arm in arms:
                    port += 1
                    per_arm[arm]["marginal"] = marginal(lab, args, arm, args.out / f"{rate:g}mbit" / f"{arm}-short",
                                                        port, per_arm[arm])
        target = max(a["curve"][-1]["val_loss"] for a in per_arm.values())
        for a in per_arm.values():
            a["target_loss"] = target
            a["time_to_target"] = {k: time_to(a["curve"], target, k) for k in ("wall_s", "model_s")}
        study["rates"][f"{rate:g}"] = per_arm
    (args.out / "study.json").write_text(json.dumps(study, indent=1))
    (args.out / "study.md").write_text(table(study))
    print(table(study))
    return 0


def crossover_mbit(study: dict, arm: str, rtt_ms: float, base: str = "adamw") -> float | None:
    """The link rate (Mbit/s) below which ``arm`` reaches the target sooner than ``base``, in the
    model: per arm, steps to the target x (compute alone + c / rate + rounds x RTT), c its measured
    communication s per step at the lowest rate times that rate. None where ``arm`` is ahead at every
    rate (or behind at every rate: then 0.0)."""
    lowest = min(study["rates"], key=float)
    per = study["rates"][lowest]

    def terms(name):
        a = per[name]
        steps = next(p["step"] for p in a["curve"] if p["val_loss"] <= a["target_loss"])
        comm = float(lowest) * a["comm_s"] / study["steps"]
        return steps, study["compute_alone_s"][name] + ROUNDS[name.split(":")[0]](study["workers"]) * rtt_ms / 1e3, comm

    (n_b, fixed_b, comm_b), (n_a, fixed_a, comm_a) = terms(base), terms(arm)
    saved, lost = n_b * comm_b - n_a * comm_a, n_a * fixed_a - n_b * fixed_b  # x / rate against a constant
    if lost <= 0:
        return None if saved >= 0 else 0.0
    return max(saved / lost, 0.0)


def _s(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f}"


def _ratios(values) -> str:
    """Per-rank ratios as their range (one line stays readable at 16 ranks)."""
    return f"{min(values):.3f}" if max(values) - min(values) < 5e-4 else f"{min(values):.3f}-{max(values):.3f}"


def table(study: dict) -> str:
    lines = ["| Mbit/s | arm | final val loss | target | to target, measured s | to target, model s "
             f"(alone compute + comm + rounds x {study['rtt_ms']:g} ms) | comm s | kernel tx / backend sent (per rank) "
             "| kernel TCP payload / backend | the same, steps alone |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rate, per_arm in study["rates"].items():
        for arm, a in per_arm.items():
            t = a["time_to_target"]
            lines.append(f"| {rate} | {arm} | {a['curve'][-1]['val_loss']:.3f} | {a['target_loss']:.3f} | "
                         f"{_s(t['wall_s'])} | {_s(t['model_s'])} | {a['comm_s']:.1f} | "
                         + _ratios(a["kernel_over_backend"]) + " | " + _ratios(a["payload_over_backend"]) + " | "
                         + (_ratios(a["marginal"]["payload_over_backend"]) if "marginal" in a else "-") + " |")
    lines.append("")
    for arm in next(iter(study["rates"].values())):
        if arm != "adamw":
            for rtt in (0.0, study["rtt_ms"]):
                r = crossover_mbit(study, arm, rtt)
                said = "ahead at every rate" if r is None else f"ahead below {r:.0f} Mbit/s"
                lines.append(f"- {arm} against adamw, RTT {rtt:g} ms (model): {said}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
