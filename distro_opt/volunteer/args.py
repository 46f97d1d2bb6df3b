"""distro-peer's options, and every check that can refuse them before the DHT starts (bad input is
one ``error:`` line and exit status 2, and nothing is started or written)."""

from __future__ import annotations

import argparse
import inspect
import math

import torch
from torch import nn

from distro_opt.cli_args import DefaultsHelpFormatter, Parser, UsageError, at_least

from .outputs import check_outputs
from .tasks import SYNTHETIC, LanguageTask, language_presets, make_task
from .training import make_optimizer

PUBLIC_UNTRUSTED_FRACTION = 0.25  # trimmed per side in a run without --allow-peers (robust.py)

DESCRIPTION = (
    "A volunteer peer: join (or start) a run over hivemind and train its own data shard with DisTrO-AdamW."
)


def number(cast, low, exclusive=False):
    """``cli_args.at_least``, and finite: an infinite or NaN time would wait forever or compare as nothing."""
    check = at_least(cast, low, exclusive)

    def convert(text):
        value = check(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number")
        return value

    convert.__name__ = cast.__name__
    return convert


def build_parser() -> Parser:
    presets = language_presets()
    p = Parser(
        prog="distro-peer",
        description=DESCRIPTION,
        formatter_class=DefaultsHelpFormatter,
        epilog="Exit status: 0 done, 2 bad input (refused before the DHT starts; nothing written), "
        "1 the run failed (e.g. an initial peer unreachable, no peer served state to --join), 130 Ctrl-C "
        "(one line; the peer leaves the run at once and still writes --out, marked interrupted).",
    )
    p.add_argument("--run-id", required=True, help="1-64 characters of A-Z a-z 0-9 _ . -")
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddresses of a running peer, as it printed them (ending in /p2p/PEER_ID)",
    )
    p.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/127.0.0.1/tcp/0"],
        metavar="MADDR",
        help="where to listen (/ip4/0.0.0.0/... for every interface; tcp/0: any free port)",
    )
    p.add_argument("--client-mode", action="store_true", help="behind NAT: open streams, accept none")
    p.add_argument(
        "--allow-peers", nargs="+", default=None, metavar="PEER_ID", help="private run: only these peer ids"
    )
    p.add_argument(
        "--untrusted-fraction",
        type=number(float, 0),
        default=None,
        help="share of contributors that may be rogues, < 0.5: above 0 each DCT coefficient is a trimmed "
        f"mean over all contributors (default {PUBLIC_UNTRUSTED_FRACTION} for a public run, 0 with --allow-peers)",
    )
    p.add_argument(
        "--preset",
        default=SYNTHETIC,
        choices=[SYNTHETIC, *presets],
        metavar="NAME",
        help=f"'{SYNTHETIC}' (no data needed) or an experiments preset ({', '.join(presets)}; e.g. 'smoke', "
        "a small transformer on the cached corpus)",
    )
    count, index = number(int, 1), number(int, 0)
    p.add_argument("--num-shards", type=count, default=8, help="language presets: number of corpus shards")
    p.add_argument("--seed", type=index, default=0, help="initial parameters and data: same on every peer")
    p.add_argument("--shard", type=index, default=0, help="language presets: 0 .. --num-shards - 1")
    p.add_argument("--steps", type=count, default=100, help="train until the run's step reaches this")
    p.add_argument("--lr", type=number(float, 0), default=3e-3, help="DisTrO-AdamW's learning rate")
    p.add_argument("--join", action="store_true", help="download state from a live peer before training")
    p.add_argument("--join-after-step", type=index, default=0, help="with --join: wait for this run step")
    p.add_argument(
        "--min-peers",
        type=count,
        default=1,
        help="wait up to --wait-peers-s for this many peers (self included); if fewer arrive, say so on "
        "stderr and train with those present (later peers can still --join)",
    )
    seconds, positive_seconds = number(float, 0), number(float, 0, exclusive=True)
    p.add_argument(
        "--wait-peers-s",
        type=seconds,
        default=30.0,
        help="how long to wait for --min-peers (with --join: for --join-after-step)",
    )
    p.add_argument(
        "--step-timeout-s",
        type=positive_seconds,
        default=10.0,
        help="a step goes on without the payloads that have not arrived by then",
    )
    heartbeat = "how often this peer tells the DHT it is alive; must be < --ttl-s"
    p.add_argument("--heartbeat-s", type=positive_seconds, default=1.0, help=heartbeat)
    p.add_argument("--ttl-s", type=positive_seconds, default=4.0, help="a peer silent this long has left")
    p.add_argument("--exclude-s", type=seconds, default=60.0, help="how long a garbage sender is ignored")
    p.add_argument(
        "--checksum-every",
        type=index,
        default=5,
        help="compare replica checksums with the other peers every this many steps (0: never)",
    )
    p.add_argument(
        "--linger-s", type=seconds, default=2.0, help="keep serving logs/state after the last step"
    )
    p.add_argument(
        "--maddrs-file",
        default=None,
        help="write this peer's multiaddresses here (a new file: never overwritten)",
    )
    p.add_argument(
        "--out", default=None, help="write a JSON summary here at the end (a new file: never overwritten)"
    )
    p.add_argument("--verbose", action="store_true", help="hivemind and backend logs at INFO")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def backend_settings(args) -> dict:
    """The ``HivemindBackend`` settings the program's flags set (besides the run id and addresses)."""
    return dict(
        exclude_s=args.exclude_s,
        step_timeout_s=args.step_timeout_s,
        heartbeat_s=args.heartbeat_s,
        ttl_s=args.ttl_s,
    )


def untrusted_fraction(args) -> float:
    """The backend's ``untrusted_fraction``: a run open to strangers (no allow list) defaults to
    trimming a quarter of each coefficient's values on each side (robust to 1 rogue of 4, 2 of 8)."""
    if args.untrusted_fraction is not None:
        return args.untrusted_fraction
    return 0.0 if args.allow_peers else PUBLIC_UNTRUSTED_FRACTION


def check_backend_settings(args) -> None:
    """The backend's own checks (run id, times), with its defaults for what the flags do not set."""
    from distro_opt.comm.hivemind_backend import HivemindBackend, check_settings

    defaults = inspect.signature(HivemindBackend).parameters
    settings = {n: defaults[n].default for n in inspect.signature(check_settings).parameters if n != "run_id"}
    settings.update(backend_settings(args))
    check_settings(args.run_id, **settings)
    if not untrusted_fraction(args) < 0.5:
        raise UsageError(f"--untrusted-fraction {args.untrusted_fraction:g}: expected < 0.5 (a majority must be honest)")


def check_addresses(args) -> None:
    """Parse every multiaddress and peer id with hivemind's parser (the p2p daemon would otherwise
    refuse them only after the DHT process started)."""
    from hivemind.utils.multiaddr import Multiaddr

    def parse(flag: str, text: str, what: str = "multiaddress", maddr: str | None = None):
        try:
            protocols = [p.name for p in Multiaddr(text if maddr is None else maddr).protocols()]
        except Exception as exc:  # noqa: BLE001 - whatever the parser raises, the text is no address
            raise UsageError(f"{flag}: invalid {what} {text!r} ({exc})") from None
        if not protocols:
            raise UsageError(f"{flag}: invalid {what} {text!r} (empty)")
        return protocols

    for maddr in args.host_maddrs:
        parse("--host-maddrs", maddr)
    for maddr in args.initial_peers:
        protocols = parse("--initial-peers", maddr)
        if len(protocols) < 2 or protocols[-1] != "p2p":
            raise UsageError(
                f"--initial-peers: {maddr!r} does not end in /p2p/PEER_ID after an address "
                "(pass the maddrs a running peer printed)"
            )
    for peer in args.allow_peers or ():
        parse("--allow-peers", peer, what="peer id", maddr=f"/p2p/{peer}")


def check_args(args):
    """Everything that can be refused before the DHT starts: the output files, the backend settings,
    the addresses, the preset (its corpus loaded, the shard checked against it) and the optimizer's
    hyperparameters. Raises ``UsageError``, ``ValueError``, ``CorpusError`` or ``OSError``; returns the
    task, so that the corpus is loaded once."""
    check_outputs(args.maddrs_file, args.out)
    check_backend_settings(args)
    check_addresses(args)
    if args.join and not args.initial_peers:
        raise UsageError("--join needs --initial-peers (the maddrs a running peer of the run printed)")
    if args.preset != SYNTHETIC and args.shard >= args.num_shards:
        raise UsageError(
            f"--shard {args.shard} is out of range for --num-shards {args.num_shards} "
            f"(expected 0 .. {args.num_shards - 1})"
        )
    task = make_task(args.preset, args.num_shards, args.seed)
    if isinstance(task, LanguageTask):
        task.check_fits()
    from distro_opt.comm import SingleWorkerBackend

    make_optimizer(args.lr, [nn.Parameter(torch.zeros(1))], SingleWorkerBackend())  # hyperparameters
    return task
