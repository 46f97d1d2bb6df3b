"""Per-step bytes of every arm, from the model's shapes alone (meta device: no memory, no training).

    python -m experiments.bytes --preset llama-1.2b --workers 32

AdamW's dense gradient exchange is shown under both conventions (``CommStats``): a ring all-reduce
(bytes sent per worker, 2(N-1)/N x gradient) and the naive peer-to-peer gather the DisTrO report
counted (bytes received per worker, (N-1) x gradient: 31 x 2.4 GB = 74.4 GB for 1.2B bf16 parameters
among 32 nodes). Each compressed setting's payload is the optimizer's own ``payload_nbytes``,
gathered by ``CommStats.all_gather_bytes``.
"""

from __future__ import annotations

import json
import sys

import torch

from distro_opt.cli_args import Parser, fail
from distro_opt.comm import CommStats, SingleWorkerBackend

from .arms import build_optimizer, check_arm, parse_arms
from .model import Transformer, count_parameters
from .presets import PRESETS, get_preset

DEFAULT_SETTINGS = "distro,distro:update=sign,distro:update=sign,topk=8,bits=2,distro:update=sign,topk=64,bits=2,demo"
DISTRO_REPORT = {
    "n_params": 1_200_000_000,
    "workers": 32,
    "baseline_bytes": 74.4e9,
    "payload_bytes": 86.8e6,
    "ratio": 857,
}


def report_baseline_bytes() -> int:
    """The DisTrO report's AdamW figure, recomputed: naive gather of 1.2e9 bf16 parameters among 32 nodes."""
    return CommStats.naive_all_reduce_bytes(2 * DISTRO_REPORT["n_params"], DISTRO_REPORT["workers"])


def dense_rows(n_params: int, world: int) -> list[dict]:
    rows = []
    for dtype, width in (("bf16", 2), ("fp32", 4)):
        size = width * n_params
        rows.append(
            {
                "arm": f"adamw ring all-reduce {dtype}",
                "message_bytes": size,
                "sent_bytes": CommStats.ring_all_reduce_bytes(size, world),
                "received_bytes": CommStats.ring_all_reduce_bytes(size, world),
            }
        )
        rows.append(
            {
                "arm": f"adamw naive gather {dtype}",
                "message_bytes": size,
                "sent_bytes": CommStats.naive_all_reduce_bytes(size, world),
                "received_bytes": CommStats.naive_all_reduce_bytes(size, world),
            }
        )
    return rows


def payload_nbytes(arm, preset) -> int:
    """The optimizer's payload for the preset's model, built on the meta device."""
    with torch.device("meta"):
        model = Transformer(preset.model_config())
    opt = build_optimizer(arm, list(model.named_parameters()), preset, SingleWorkerBackend())
    return int(opt.payload_nbytes)


def compressed_rows(settings: str, preset, world: int) -> list[dict]:
    rows = []
    for arm in parse_arms(settings):
        if arm.kind == "adamw":
            continue
        check_arm(arm, preset)
        size = payload_nbytes(arm, preset)
        rows.append(
            {
                "arm": arm.label,
                "message_bytes": size,
                "sent_bytes": CommStats.all_gather_bytes(size, world),
                "received_bytes": CommStats.all_gather_bytes(size, world),
            }
        )
    return rows


def table(preset, world: int, settings: str) -> dict:
    n = count_parameters(preset.model_config())
    rows = dense_rows(n, world) + compressed_rows(settings, preset, world)
    ring = CommStats.ring_all_reduce_bytes(2 * n, world)
    naive = CommStats.naive_all_reduce_bytes(2 * n, world)
    for r in rows:
        r["bytes_per_param"] = r["message_bytes"] / n
        r["vs_dense_bf16"] = 2 * n / r["message_bytes"]
        r["vs_ring_allreduce_bf16"] = ring / r["sent_bytes"]
        r["vs_naive_gather_bf16"] = naive / r["received_bytes"]
    return {"preset": preset.name, "workers": world, "n_params": n, "rows": rows}


def render(result: dict) -> str:
    n, world = result["n_params"], result["workers"]
    naive = CommStats.naive_all_reduce_bytes(2 * n, world)
    lines = [
        f"{result['preset']}: {n:,} parameters, {world} workers; bytes per worker per step",
        f"DisTrO report baseline (naive gather, bf16): {world - 1} x {2 * n / 1e9:.2f} GB "
        f"= {naive / 1e9:.1f} GB "
        f"(the report rounds to 1.2e9 parameters: 31 x 2.40 GB = {report_baseline_bytes() / 1e9:.1f} GB)",
        "",
        f"{'arm':34} {'message':>12} {'sent':>12} {'received':>12} {'B/param':>9} {'vs bf16':>9} "
        f"{'vs ring':>9} {'vs naive':>9}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['arm']:34} {_h(r['message_bytes']):>12} {_h(r['sent_bytes']):>12} "
            f"{_h(r['received_bytes']):>12} {r['bytes_per_param']:>9.4f} {r['vs_dense_bf16']:>8.1f}x "
            f"{r['vs_ring_allreduce_bf16']:>8.1f}x {r['vs_naive_gather_bf16']:>8.1f}x"
        )
    lines.append(
        f"\nDisTrO report: {DISTRO_REPORT['payload_bytes'] / 1e6:.1f} MB received per node per step "
        f"(31 x 2.8 MB), {DISTRO_REPORT['ratio']}x less than the naive bf16 baseline."
    )
    return "\n".join(lines)


def _h(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def main(argv=None) -> int:
    p = Parser(prog="python -m experiments.bytes", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-1.2b", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--workers", type=int, default=None, help="number of workers (default: the preset's)")
    p.add_argument(
        "--settings", default=DEFAULT_SETTINGS, help=f"compressed arms (default {DEFAULT_SETTINGS})"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:
        preset = get_preset(args.preset)
        world = args.workers if args.workers is not None else preset.workers
        if world < 2:
            raise ValueError(f"Invalid workers: {world} (expected >= 2)")
        result = table(preset, world, args.settings)
    except ValueError as exc:
        return fail(str(exc))
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
