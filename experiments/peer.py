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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from .files import write_atomic

COMPRESSION = {"topk": 8, "chunk": 64, "bits": 8}


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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-id", required=True)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--host-maddrs", nargs="*", default=["/ip4/127.0.0.1/tcp/0"])
    p.add_argument("--client-mode", action="store_true", help="behind NAT: open streams, accept none")
    p.add_argument("--allow-peers", nargs="*", default=None, help="private run: only these peer ids")
    p.add_argument(
        "--preset",
        default="synthetic",
        help="'synthetic' (no data needed) or an experiments preset name such as 'smoke' (a small "
        "transformer on the cached corpus)",
    )
    p.add_argument(
        "--num-shards", type=int, default=8, help="language presets: the corpus is cut in this many"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--steps", type=int, default=100, help="train until the run's step reaches this")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--join", action="store_true", help="download state from a live peer before training")
    p.add_argument(
        "--join-after-step", type=int, default=0, help="with --join: wait until the run reaches this step"
    )
    p.add_argument("--min-peers", type=int, default=1, help="wait for this many peers (self included)")
    p.add_argument("--wait-peers-s", type=float, default=30.0)
    p.add_argument("--step-timeout-s", type=float, default=10.0)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--ttl-s", type=float, default=4.0)
    p.add_argument(
        "--exclude-s", type=float, default=60.0, help="how long a peer that sent garbage is ignored"
    )
    p.add_argument("--checksum-every", type=int, default=5)
    p.add_argument("--step-delay-s", type=float, default=0.0, help="extra compute time per step (tests)")
    p.add_argument("--linger-s", type=float, default=2.0, help="keep serving logs/state after the last step")
    p.add_argument(
        "--perturb-at-step",
        type=int,
        default=-1,
        help="testing: nudge this peer's parameters after that step, so that the replica checksum guard "
        "must notice the divergence and reload state from the majority",
    )
    p.add_argument("--maddrs-file", default=None, help="write this peer's multiaddresses here")
    p.add_argument("--out", default=None, help="write a JSON summary here at the end")
    p.add_argument("--verbose", action="store_true", help="hivemind and backend logs at INFO")
    return p.parse_args(argv)


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


def make_backend(args):
    from distro_opt.comm.hivemind_backend import HivemindBackend

    return HivemindBackend(
        args.run_id,
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        client_mode=args.client_mode,
        allow_peers=args.allow_peers,
        exclude_s=args.exclude_s,
        step_timeout_s=args.step_timeout_s,
        heartbeat_s=args.heartbeat_s,
        ttl_s=args.ttl_s,
    )


def build(args, comm):
    """The task, the model and the optimizer (every peer of a run must build the same ones)."""
    from distro_opt import DisTrOAdamW

    if args.preset == "synthetic":
        task = SyntheticTask(seed=args.seed)
    else:
        task = LanguageTask(args.preset, num_shards=args.num_shards, seed=args.seed)
    model = task.model()
    opt = DisTrOAdamW(
        model.parameters(),
        lr=args.lr,
        weight_decay=0.0,
        compression_topk=COMPRESSION["topk"],
        compression_chunk=COMPRESSION["chunk"],
        compression_bits=COMPRESSION["bits"],
        comm=comm,
    )
    return task, model, opt


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


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    backend = make_backend(args)
    task, model, opt = build(args, backend)
    backend.state_provider = lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()}
    backend.payload_validator = payload_validator(opt)
    print(f"peer {backend.peer_id} maddrs {' '.join(backend.visible_maddrs)}", flush=True)
    if args.maddrs_file:
        write_atomic(args.maddrs_file, "\n".join(backend.visible_maddrs))  # readers never see half of it
    t0 = time.monotonic()
    summary = {"peer": backend.peer_id, "steps": [], "resyncs": 0}
    published: dict[int, str] = {}  # our replica checksums by step, until compared with the others'
    try:
        if args.join:
            wait_for_run_step(backend, args.join_after_step, args.wait_peers_s)
            load_into(model, opt, backend.load_state_from_peers())
            print(f"joined at step {backend.step}", flush=True)
        else:
            backend.wait_for_peers(args.min_peers - 1, args.wait_peers_s)
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
            with open(args.out, "w") as f:
                json.dump(summary, f)
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
