"""The volunteer's training loop: one DisTrO-AdamW step per run step over a hivemind backend, a
status line per step, and the replica guard (peers publish a checksum of their parameters every
``--checksum-every`` steps; one that does not hold the checksum the reports choose reloads state
from a peer that does: ``hivemind_membership.replica_choice``)."""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch
from torch import nn

from .outputs import write_new
from .tasks import make_task

# DeMo's sign rule: the one this program's tasks, their lrs and the robustness study
# (docs/volunteers.md) were measured with
COMPRESSION = {"topk": 8, "chunk": 64, "bits": 8, "update": "sign"}
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


def make_optimizer(lr: float, params, comm):
    from distro_opt import DisTrOAdamW

    return DisTrOAdamW(
        params,
        lr=lr,
        weight_decay=0.0,
        compression_topk=COMPRESSION["topk"],
        compression_chunk=COMPRESSION["chunk"],
        compression_bits=COMPRESSION["bits"],
        update=COMPRESSION["update"],
        comm=comm,
    )


def build(args, comm, task=None):
    """The task, the model and the optimizer (every peer of a run must build the same ones)."""
    task = make_task(args.preset, args.num_shards, args.seed) if task is None else task
    model = task.model()
    return task, model, make_optimizer(args.lr, model.parameters(), comm)


def checksum(model: nn.Module) -> str:
    return state_checksum(model.state_dict())


def state_checksum(model_state: dict) -> str:
    """The replica checksum of a model state dict (``checksum`` of the model that holds it); the
    digest a state download must match, which leaves out each worker's own optimizer state."""
    h = hashlib.sha256()
    for t in model_state.values():
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def load_into(model, opt, state) -> None:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def payload_validator(opt):
    """``buf -> bool``: does ``buf`` decode under the optimizer's payload layout (size, fingerprint,
    indices in range, finite values)? The backend calls it on every received payload before the vote."""
    from distro_opt import PayloadError

    layout = opt.payload_layout

    def valid(buf) -> bool:
        try:
            layout.unpack(buf)
        except PayloadError:
            return False
        return True

    return valid


def train(args, task, backend, after_step=None) -> int:
    """Build the model and optimizer on ``backend``, train, write the outputs; close the backend.
    ``after_step(step, model)``, if given, runs at the end of each step, after the replica checks:
    where a test slows a peer down or makes its replica diverge.

    After its last step the peer leaves the run at once (``backend.leave``: nobody waits for its next
    round), then writes ``--out`` and lingers ``--linger-s`` for state downloads under way. Ctrl-C
    (KeyboardInterrupt) while it joins or trains ends the same way, with one line on stderr, the
    summary marked ``"interrupted": true``, no lingering and exit status 130."""
    try:
        task, model, opt = build(args, backend, task)
        backend.state_provider = lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()}
        backend.state_digest = lambda state: state_checksum(state["model"])
        backend.payload_validator = payload_validator(opt)
        print(f"peer {backend.peer_id} maddrs {' '.join(backend.visible_maddrs)}", flush=True)
        if args.maddrs_file:
            write_new(args.maddrs_file, "\n".join(backend.visible_maddrs))  # readers never see half of it
        summary = {"peer": backend.peer_id, "steps": [], "resyncs": 0, "first_step": None}
        try:
            _join_and_train(args, task, backend, model, opt, summary, after_step)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        backend.leave()
        summary.update(
            interrupted=interrupted,
            final_step=backend.step,
            checksum=checksum(model),
            finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            bytes_sent=backend.stats.bytes_sent,
            bytes_received=backend.stats.bytes_received,
        )
        if interrupted:
            print(f"interrupted at step {backend.step}" + (f"; summary in {args.out}" if args.out else ""),
                  file=sys.stderr, flush=True)
        else:
            print(f"done step {backend.step} checksum {summary['checksum']}", flush=True)
        if args.out:
            write_new(args.out, json.dumps(summary))
        if not interrupted:
            time.sleep(args.linger_s)
    finally:
        backend.close()
    return EXIT_INTERRUPTED if interrupted else 0


def _join_and_train(args, task, backend, model, opt, summary: dict, after_step) -> None:
    t0 = time.monotonic()
    published: dict[int, str] = {}  # our replica checksums by step, until compared with the others'
    if args.join:
        wait_for_run_step(backend, args.join_after_step, args.wait_peers_s)
        load_into(model, opt, backend.load_state_from_peers())
        print(f"joined at step {backend.step}", flush=True)
    else:
        wait_for_min_peers(backend, args.min_peers, args.wait_peers_s)
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
        # recorded before it is printed: a Ctrl-C between the two never leaves a printed step out of --out
        summary["steps"].append(
            {"step": step, "loss": loss.item(), "peers": backend.world_size, "gather_s": gather_s}
        )
        print(
            f"step {step} | loss {loss.item():.5f} | peers {backend.world_size} "
            f"| sent_bytes {st.bytes_sent} | recv_bytes {st.bytes_received} "
            f"| gather_s {gather_s:.3f} | t_s {time.monotonic() - t0:.1f}",
            flush=True,
        )
        if backend.out_of_sync:
            resync(backend, model, opt, summary)
            published.clear()  # checksums of the replica we just replaced compare nothing
        elif args.checksum_every:
            check_replica(backend, model, opt, step, args.checksum_every, published, summary)
        if after_step is not None:
            after_step(step, model)


def wait_for_min_peers(backend, min_peers: int, timeout_s: float) -> None:
    """Wait (bounded) for ``min_peers`` peers, self included; if fewer arrive, say so on stderr."""
    others = backend.wait_for_peers(min_peers - 1, timeout_s)
    if others + 1 < min_peers:
        print(
            f"warning: {others + 1} of --min-peers {min_peers} peers arrived within "
            f"--wait-peers-s {timeout_s:g}; training with {others + 1} (later peers can still --join)",
            file=sys.stderr,
            flush=True,
        )


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
    time to publish theirs); reload state from the peers holding the chosen checksum if we differ."""
    holders = backend.compare_checksum(step, mine)
    if holders:
        print(f"replica differs from the one {len(holders)} peer(s) hold at step {step}: reloading state",
              flush=True)
        resync(backend, model, opt, summary, prefer=holders)
