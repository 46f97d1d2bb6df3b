"""A volunteer peer: join (or start) a run over hivemind and train its own data shard with DisTrO-AdamW.

    python -m experiments.peer --run-id demo --steps 200                      # first peer; prints maddrs
    python -m experiments.peer --run-id demo --initial-peers /ip4/.../p2p/... --join --shard 1

Each step prints ``step | loss | peers | sent_bytes | recv_bytes | gather_s``. Peers that started
together begin from the same seed; a ``--join`` peer downloads parameters and optimizer state from a
live peer first. Every ``--checksum-every`` steps peers publish a checksum of their parameters in the
DHT; a peer that disagrees with the majority reloads state from it.

Preset ``synthetic`` (default, no download): an MLP learns a fixed random teacher network; each
shard draws its own inputs. The teacher is the same for every peer, so the loss falls for all.
Any ``experiments.presets`` name (e.g. ``smoke``) trains that preset's transformer on its cached
corpus instead, shard ``--shard`` of ``--num-shards``.

Exit status: 0 when done; 2 for bad input (one ``error:`` line; everything is checked before the
DHT starts, and no file is written); 1 when the run fails (an initial peer unreachable, no peer to
serve state to a ``--join``, ...: one ``error:`` line, ``--verbose`` adds the traceback); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import math
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from distro_opt.cli_args import Parser, UsageError, at_least, fail, os_error_message

COMPRESSION = {"topk": 8, "chunk": 64, "bits": 8}
EXIT_FAILED, EXIT_INTERRUPTED = 1, 130
SYNTHETIC = "synthetic"


@dataclass
class SyntheticTask:
    """Regression onto a fixed random 2-layer teacher: y = w2 . tanh(W1 x)."""

    in_dim: int = 16
    hidden: int = 48  # not a power of two: index fields can hold out-of-range values, which receivers reject
    batch_size: int = 64
    seed: int = 0

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)  # identical initial replicas on every peer that starts the run
        return nn.Sequential(
            nn.Linear(self.in_dim, self.hidden),
            nn.Tanh(),
            nn.Linear(self.hidden, self.hidden),
            nn.Tanh(),
            nn.Linear(self.hidden, 1),
        )

    def batch(self, shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        teacher = torch.Generator().manual_seed(10_000 + self.seed)
        w1 = torch.randn(self.in_dim, 32, generator=teacher) / self.in_dim**0.5
        w2 = torch.randn(32, 1, generator=teacher) / 32**0.5
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + shard * 7919 + step) & 0x7FFFFFFF)
        x = torch.randn(self.batch_size, self.in_dim, generator=g)
        return x, torch.tanh(x @ w1) @ w2

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)


@dataclass
class LanguageTask:
    """Next-token prediction with an ``experiments.presets`` model on its cached corpus (prepare it
    first with ``python -m experiments.prepare``); shard ``i`` of ``num_shards`` reads its own slice."""

    preset: str = "smoke"
    num_shards: int = 8
    seed: int = 0

    def __post_init__(self):
        from distro_opt.experiments.data import load_corpus
        from distro_opt.experiments.presets import get_preset

        self.cfg = get_preset(self.preset)
        self.corpus = load_corpus(self.cfg.corpus, self.cfg.tokenizer, self.cfg.vocab_size)

    def model(self) -> nn.Module:
        from distro_opt.experiments.model import build_model

        return build_model(self.cfg.model_config(self.corpus.vocab_size), seed=self.seed)

    def batch(self, shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        from distro_opt.experiments.data import worker_batch

        return worker_batch(
            self.corpus.train,
            step=step,
            rank=shard % self.num_shards,
            world_size=self.num_shards,
            batch_size=self.cfg.batch_size,
            seq_len=self.cfg.seq_len,
            seed=self.seed,
        )

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x, y)


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
    from distro_opt.experiments.presets import PRESETS

    p = Parser(
        prog="distro-peer",
        description=__doc__.split("\n")[0],
        epilog="Exit status: 0 done, 2 bad input (refused before the DHT starts; nothing written), "
        "1 the run failed (e.g. an initial peer unreachable, no peer served state to --join), 130 Ctrl-C.",
    )
    p.add_argument("--run-id", required=True, help="1-64 characters of A-Z a-z 0-9 _ . -")
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddresses of a running peer, as it printed them (ending in /p2p/PEER_ID)",
    )
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"], metavar="MADDR")
    p.add_argument("--client-mode", action="store_true", help="behind NAT: open streams, accept none")
    p.add_argument(
        "--allow-peers", nargs="+", default=None, metavar="PEER_ID", help="private run: only these peer ids"
    )
    p.add_argument(
        "--preset",
        default=SYNTHETIC,
        choices=[SYNTHETIC, *PRESETS],
        metavar="NAME",
        help=f"'{SYNTHETIC}' (no data needed) or an experiments preset ({', '.join(PRESETS)}; e.g. 'smoke', "
        "a small transformer on the cached corpus)",
    )
    p.add_argument(
        "--num-shards",
        type=number(int, 1),
        default=8,
        help="language presets: the corpus is cut in this many",
    )
    p.add_argument("--seed", type=number(int, 0), default=0)
    p.add_argument("--shard", type=number(int, 0), default=0, help="language presets: 0 .. --num-shards - 1")
    p.add_argument(
        "--steps", type=number(int, 1), default=100, help="train until the run's step reaches this"
    )
    p.add_argument("--lr", type=number(float, 0), default=3e-3)
    p.add_argument("--join", action="store_true", help="download state from a live peer before training")
    p.add_argument(
        "--join-after-step",
        type=number(int, 0),
        default=0,
        help="with --join: wait until the run reaches this step",
    )
    p.add_argument(
        "--min-peers",
        type=number(int, 1),
        default=1,
        help="wait up to --wait-peers-s for this many peers (self included); if fewer arrive, say so on "
        "stderr and train with those present (later peers can still --join)",
    )
    p.add_argument("--wait-peers-s", type=number(float, 0), default=30.0)
    p.add_argument("--step-timeout-s", type=number(float, 0, exclusive=True), default=10.0)
    p.add_argument(
        "--heartbeat-s", type=number(float, 0, exclusive=True), default=1.0, help="must be < --ttl-s"
    )
    p.add_argument("--ttl-s", type=number(float, 0, exclusive=True), default=4.0)
    p.add_argument(
        "--exclude-s",
        type=number(float, 0),
        default=60.0,
        help="how long a peer that sent garbage is ignored",
    )
    p.add_argument("--checksum-every", type=number(int, 0), default=5, help="0: never compare replicas")
    p.add_argument(
        "--step-delay-s", type=number(float, 0), default=0.0, help="extra compute time per step (tests)"
    )
    p.add_argument(
        "--linger-s", type=number(float, 0), default=2.0, help="keep serving logs/state after the last step"
    )
    p.add_argument(
        "--perturb-at-step",
        type=number(int, -1),
        default=-1,
        help="testing: nudge this peer's parameters after that step, so that the replica checksum guard "
        "must notice the divergence and reload state from the majority",
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


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def configure_logging(verbose: bool) -> None:
    # hivemind reads its level at import time and in the DHT child, so set both before importing it
    level = "INFO" if verbose else "ERROR"
    os.environ.setdefault("HIVEMIND_LOGLEVEL", level)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.ERROR,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("distro_opt").setLevel(logging.DEBUG if verbose else logging.WARNING)


def load_into(model, opt, state) -> None:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def backend_settings(args) -> dict:
    """The ``HivemindBackend`` settings the program's flags set (besides the run id and addresses)."""
    return dict(
        exclude_s=args.exclude_s,
        step_timeout_s=args.step_timeout_s,
        heartbeat_s=args.heartbeat_s,
        ttl_s=args.ttl_s,
    )


def make_backend(args):
    from distro_opt.comm.hivemind_backend import HivemindBackend

    return HivemindBackend(
        args.run_id,
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        client_mode=args.client_mode,
        allow_peers=args.allow_peers,
        **backend_settings(args),
    )


def make_task(args):
    """The task of ``--preset`` (a language preset loads its corpus here: ``CorpusError`` if missing)."""
    if args.preset == SYNTHETIC:
        return SyntheticTask(seed=args.seed)
    return LanguageTask(args.preset, num_shards=args.num_shards, seed=args.seed)


def make_optimizer(args, params, comm):
    from distro_opt import DisTrOAdamW

    return DisTrOAdamW(
        params,
        lr=args.lr,
        weight_decay=0.0,
        compression_topk=COMPRESSION["topk"],
        compression_chunk=COMPRESSION["chunk"],
        compression_bits=COMPRESSION["bits"],
        comm=comm,
    )


def build(args, comm, task=None):
    """The task, the model and the optimizer (every peer of a run must build the same ones)."""
    task = make_task(args) if task is None else task
    model = task.model()
    return task, model, make_optimizer(args, model.parameters(), comm)


def check_outputs(args) -> None:
    """``--maddrs-file`` and ``--out`` are new files: one that exists is refused now, before anything
    starts, and so is one whose directory is missing (found only at the end of the run otherwise)."""
    flags = (("--maddrs-file", args.maddrs_file), ("--out", args.out))
    named = [(flag, path) for flag, path in flags if path]
    if len(named) == 2 and os.path.abspath(args.out) == os.path.abspath(args.maddrs_file):
        raise UsageError(f"--out and --maddrs-file both name {args.out}; choose two files")
    for flag, path in named:
        if os.path.lexists(path):
            raise UsageError(f"{flag} {path} exists; choose another file (distro-peer overwrites none)")
        parent = Path(path).parent
        if not parent.is_dir():
            raise UsageError(f"{flag} {path}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: directory {parent} is not writable")


def check_backend_settings(args) -> None:
    """The backend's own checks (run id, times), with its defaults for what the flags do not set."""
    from distro_opt.comm.hivemind_backend import HivemindBackend, check_settings

    defaults = inspect.signature(HivemindBackend).parameters
    settings = {n: defaults[n].default for n in inspect.signature(check_settings).parameters if n != "run_id"}
    settings.update(backend_settings(args))
    check_settings(args.run_id, **settings)


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
    check_outputs(args)
    check_backend_settings(args)
    check_addresses(args)
    if args.join and not args.initial_peers:
        raise UsageError("--join needs --initial-peers (the maddrs a running peer of the run printed)")
    if args.preset != SYNTHETIC and args.shard >= args.num_shards:
        raise UsageError(
            f"--shard {args.shard} is out of range for --num-shards {args.num_shards} "
            f"(expected 0 .. {args.num_shards - 1})"
        )
    task = make_task(args)
    if isinstance(task, LanguageTask):  # a shard too small for one window: refused now, not at step 0
        from distro_opt.experiments.data import check_corpus_fits

        check_corpus_fits(
            task.corpus, seq_len=task.cfg.seq_len, workers=args.num_shards, sharding="contiguous"
        )
    from distro_opt.comm import SingleWorkerBackend

    make_optimizer(args, [nn.Parameter(torch.zeros(1))], SingleWorkerBackend())  # hyperparameters
    return task


def payload_validator(opt):
    """``buf -> bool``: does ``buf`` decode under the optimizer's payload layout (size, fingerprint,
    indices in range, finite values)? The backend calls it on every received payload before the vote."""
    from distro_opt import PayloadError

    layout = opt.payload_layout

    def valid(buf) -> bool:
        try:
            layout.decode(buf)
        except PayloadError:
            return False
        return True

    return valid


_GO_LOG_TIME = re.compile(r"\b\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(\.\d+)? ")  # p2pd's log prefix, in its errors


def one_line(exc: BaseException) -> str:
    text = _GO_LOG_TIME.sub("", " ".join(str(exc).split()))
    return text or type(exc).__name__


def write_new(path, text: str) -> None:
    """Write a file that must not exist, whole or not at all: a temporary file beside it, then a hard
    link to the name, which (unlike the rename of ``files.write_atomic``) fails if the name is taken
    (``FileExistsError``). Where the file system has no hard links, an exclusive create instead."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        try:
            os.link(tmp, path)
        except FileExistsError as exc:  # it names the temporary file first: name the one that exists
            raise FileExistsError(exc.errno, exc.strerror, str(path)) from None
        except OSError:
            with open(path, "x", encoding="utf-8") as f:
                f.write(text)
    finally:
        tmp.unlink(missing_ok=True)


def run_errors() -> tuple:
    """What the library raises when a run cannot go on; printed as one line, exit status 1."""
    from hivemind.p2p import P2PDaemonError

    from distro_opt.comm.hivemind_backend import HivemindBackendError
    from distro_opt.experiments.data import CorpusError

    return (HivemindBackendError, P2PDaemonError, CorpusError, ValueError, TimeoutError)


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    try:
        return _main(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(args) -> int:
    from distro_opt.experiments.data import CorpusError

    try:
        task = check_args(args)
    except (UsageError, ValueError, CorpusError) as exc:
        return fail(one_line(exc))
    except OSError as exc:
        return fail(os_error_message(exc))
    errors = run_errors()
    try:
        backend = make_backend(args)
    except errors as exc:
        return failed(args, f"cannot start this peer: {one_line(exc)}" + _bootstrap_hint(exc))
    try:
        return train(args, task, backend)  # closes the backend
    except FileExistsError as exc:  # created by someone else since check_outputs
        return failed(args, f"{exc.filename} appeared while the peer ran; not overwritten")
    except errors as exc:
        return failed(args, one_line(exc))
    except OSError as exc:
        return failed(args, os_error_message(exc))


def _bootstrap_hint(exc) -> str:
    if "bootstrap" in str(exc):
        return " (check --initial-peers: is the peer that printed them still running, and reachable?)"
    return ""


def failed(args, message: str) -> int:
    """A run-time failure: one line (the traceback too with --verbose), exit status 1."""
    if args.verbose:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def train(args, task, backend) -> int:
    """Build the model and optimizer on ``backend``, train, write the outputs; close the backend."""
    try:
        task, model, opt = build(args, backend, task)
        backend.state_provider = lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()}
        backend.payload_validator = payload_validator(opt)
        print(f"peer {backend.peer_id} maddrs {' '.join(backend.visible_maddrs)}", flush=True)
        if args.maddrs_file:
            write_new(args.maddrs_file, "\n".join(backend.visible_maddrs))  # readers never see half of it
        t0 = time.monotonic()
        summary = {"peer": backend.peer_id, "steps": [], "resyncs": 0}
        published: dict[int, str] = {}  # our replica checksums by step, until compared with the others'
        if args.join:
            wait_for_run_step(backend, args.join_after_step, args.wait_peers_s)
            load_into(model, opt, backend.load_state_from_peers())
            print(f"joined at step {backend.step}", flush=True)
        else:
            others = backend.wait_for_peers(args.min_peers - 1, args.wait_peers_s)
            if others + 1 < args.min_peers:
                print(
                    f"warning: {others + 1} of --min-peers {args.min_peers} peers arrived within "
                    f"--wait-peers-s {args.wait_peers_s:g}; training with {others + 1} "
                    "(later peers can still --join)",
                    file=sys.stderr,
                    flush=True,
                )
        summary["first_step"] = backend.step
        while backend.step < args.steps:
            step = backend.step
            with backend.state_lock:  # a joiner's snapshot is taken between steps, never inside one
                x, y = task.batch(args.shard, step)
                loss = task.loss(model, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            gather_s = opt.last_step_timing["comm_s"]
            st = backend.stats
            print(
                f"step {step} | loss {loss.item():.5f} | peers {backend.world_size} "
                f"| sent_bytes {st.bytes_sent} | recv_bytes {st.bytes_received} "
                f"| gather_s {gather_s:.3f} | t_s {time.monotonic() - t0:.1f}",
                flush=True,
            )
            summary["steps"].append(
                {"step": step, "loss": loss.item(), "peers": backend.world_size, "gather_s": gather_s}
            )
            if step == args.perturb_at_step:
                with torch.no_grad():
                    next(model.parameters()).add_(1e-3)
            if backend.out_of_sync:
                resync(backend, model, opt, summary)
                published.clear()  # checksums of the replica we just replaced compare nothing
            elif args.checksum_every:
                check_replica(backend, model, opt, step, args.checksum_every, published, summary)
            if args.step_delay_s:
                time.sleep(args.step_delay_s)
        summary.update(
            final_step=backend.step,
            checksum=checksum(model),
            finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            bytes_sent=backend.stats.bytes_sent,
            bytes_received=backend.stats.bytes_received,
        )
        print(f"done step {backend.step} checksum {summary['checksum']}", flush=True)
        if args.out:
            write_new(args.out, json.dumps(summary))
        time.sleep(args.linger_s)
    finally:
        backend.close()
    return 0


def wait_for_run_step(backend, step: int, timeout_s: float) -> None:
    """Wait (bounded) until some active peer's heartbeat reports ``step`` or later."""
    deadline = time.monotonic() + timeout_s
    while step > 0 and time.monotonic() < deadline:
        backend.membership.refresh()
        if any(rec.step >= step for rec in backend.membership.view().values()):
            return
        time.sleep(0.2)


def resync(backend, model, opt, summary: dict, prefer=None) -> None:
    """Reload the state of a live peer; on failure stay out of sync and try again next step."""
    from distro_opt.comm.hivemind_backend import HivemindBackendError

    try:
        load_into(model, opt, backend.load_state_from_peers(prefer=prefer))
    except HivemindBackendError as exc:
        print(f"resync failed: {exc}", flush=True)
        backend.out_of_sync = True
        return
    summary["resyncs"] += 1
    print(f"resynced at step {backend.step}", flush=True)


def check_replica(backend, model, opt, step: int, every: int, published: dict, summary: dict) -> None:
    """After ``step``: compare the checksum published two steps ago (if any), then publish ours every
    ``every`` steps. Comparing and publishing are separate decisions: with ``every`` <= 2 a step can
    be both, and each published checksum is compared once, then dropped (``published`` stays small)."""
    for old in [s for s in published if s < step - 2]:
        del published[old]  # a resync moved our step past it: nothing to compare it with
    if step - 2 in published:
        resyncs = summary["resyncs"]
        guard_replica(backend, model, opt, step - 2, published.pop(step - 2), summary)
        if summary["resyncs"] != resyncs:
            published.clear()  # our state (and step) just changed: its checksum is not "after step"
            return
    if (step + 1) % every == 0:
        published[step] = checksum(model)
        backend.publish_checksum(step, published[step])


def guard_replica(backend, model, opt, step: int, mine: str, summary: dict) -> None:
    """Compare our checksum after ``step`` with the others' (published two steps ago, so that they had
    time to publish theirs); reload state from the majority if we differ."""
    majority_peers = backend.compare_checksum(step, mine)
    if majority_peers:
        print(f"replica differs from the majority at step {step}: reloading state", flush=True)
        resync(backend, model, opt, summary, prefer=majority_peers)


if __name__ == "__main__":
    sys.exit(main())
