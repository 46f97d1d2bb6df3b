"""One worker's training loop for one arm: the same code runs on an in-process thread or a torchrun rank.

Every worker holds a full replica (same initialization), trains on its own shard of the text, and
synchronizes only through its ``Backend``: AdamW all-reduces the flattened gradient (as DDP does),
DisTrOAdamW / DeMo all-gather their compressed payloads inside ``step()``. Bytes come from
``backend.stats`` and nowhere else.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distro_opt.comm import CommStats, SingleWorkerBackend
from distro_opt.shards import local

from .arms import ALONE, Arm, build_optimizer, optimizer_kwargs
from .runner_options import compression_warmup
from .checkpoint import CheckpointStore
from .coordination import StopSignal
from .data import val_batches, worker_batch
from .hybrid import shard_model
from .model import build_model
from .peer_arms import PEER_KINDS, build_peer_optimizer


def lr_factor(step: int, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to 1 over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``steps``."""
    if step <= warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class Job:
    arm: Arm
    seed: int
    preset: object
    corpus: object
    init_state: dict
    out: Path
    vocab_size: int
    resume: bool

    @classmethod
    def create(cls, arm, seed, preset, corpus, out, resume) -> "Job":
        """A job whose initial weights are the seed's fresh model: every arm starts from the same point."""
        init = build_model(preset.model_config(corpus.vocab_size), seed=seed).state_dict()
        return cls(arm=arm, seed=seed, preset=preset, corpus=corpus, init_state=init, out=out,
                   vocab_size=corpus.vocab_size, resume=resume)


def check_resumable(job: Job, world_size: int) -> None:
    """Restore every rank's newest checkpoint of ``job`` into a scratch replica, on this thread.

    A damaged or foreign file then raises ``CheckpointError`` (naming it) before any arm trains or
    any file is written, rather than as a traceback from a worker thread once the run has started.
    """
    store = CheckpointStore(job.out, job.arm.slug, job.seed, world_size)
    step = store.latest_step()
    if step == 0:
        return
    model = build_model(job.preset.model_config(job.vocab_size), seed=job.seed)
    opt = build_optimizer(job.arm, model.named_parameters(), job.preset, SingleWorkerBackend())
    for rank in range(world_size):
        store.restore(step, rank, model, opt)


def _all_reduce_gradients(model, backend) -> float:
    """DDP's gradient averaging, as one flat fp32 buffer through the same backend (bytes counted there)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # A sharded (DTensor) gradient is already reduced over its shard group by FSDP2: its local shard
    # is what the replicas average.
    grads = [local(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    t0 = time.perf_counter()
    backend.all_reduce(flat, op="mean")
    comm_s = time.perf_counter() - t0
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
    return comm_s


def clip_gradients(model, max_norm: float) -> None:
    """``clip_grad_norm_`` over the model's gradients (a no-op at ``max_norm`` 0). Psyche clips
    before compressing; torch's DDP users clip the averaged gradient: each arm gets the one it steps on."""
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.grad is not None], max_norm)


# A compression warm-up's ledger: the payload bytes this worker contributed, and what the backend
# must have counted for them, summed step by step (the payload's size changes when the warm-up ends)
_WARMUP_LEDGER = ("message_bytes", "expected_sent_bytes")


def _add_to_warmup_ledger(state: dict, payload_nbytes: int, collectives: int, world: int) -> dict:
    return {
        **state,
        "message_bytes": state["message_bytes"] + payload_nbytes * collectives,
        "expected_sent_bytes": state["expected_sent_bytes"]
        + CommStats.all_gather_bytes(payload_nbytes, world) * collectives,
    }


COUNTERS = ("sent", "received", "collectives", "check_sent", "check_received", "checks")


def _counters(backend, opt) -> tuple:
    """``COUNTERS`` now: the payload stream (what ``backend.stats`` counted, less the replica
    checks), then the replica checks (``opt.replica_check_stats``, ``distro_opt.guards``), which
    the byte ledger counts apart: they happen once per start, not per step."""
    total = backend.stats
    checks = getattr(opt, "replica_check_stats", None) or CommStats()
    return (
        total.bytes_sent - checks.bytes_sent, total.bytes_received - checks.bytes_received,
        total.steps - checks.steps, checks.bytes_sent, checks.bytes_received, checks.steps,
    )


def _count_bytes(backend, opt, state: dict, last: tuple, step: int):
    """Add what was counted since ``last`` (``_counters``) to the run's cumulative counters."""
    now = _counters(backend, opt)
    state = {**state, "step": step, **{k: state[k] + n - l for k, n, l in zip(COUNTERS, now, last)}}
    return state, now[0] - last[0], now[1] - last[1], now


@torch.no_grad()
def evaluate(model, batches, device, autocast, opt=None) -> float:
    """Mean loss over ``batches``. With a local-step optimizer, of the synced model (the last sync's
    anchor, the same on every worker), not of this worker's replica, which drifts toward its own
    shard between syncs."""
    synced = getattr(opt, "synced_parameters", None)
    with synced() if synced is not None else contextlib.nullcontext():
        return _mean_loss(model, batches, device, autocast)


def _mean_loss(model, batches, device, autocast) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            total += float(model(x.to(device), y.to(device)))
    model.train(was_training)
    return total / len(batches)


def run_worker(backend, job: Job, losses, stop: StopSignal | None, sink, hybrid=None, saves: bool = True) -> dict:
    """Train ``job.arm`` on worker ``backend.rank``; worker 0 also evaluates, and the rank given a
    ``sink`` logs and reports progress.

    The alone arm (``arms.ALONE``) is trained on a world of one: AdamW with no all-reduce. ``saves``
    False: this worker writes no checkpoint.

    ``losses`` averages the train loss over workers (``LossTable`` or a torch.distributed reducer);
    ``sink`` (one rank only) receives one metrics row per step. ``hybrid`` (``hybrid.HybridMesh``):
    the model is sharded over its shard dimension and ``backend`` is its replicate group, so a worker
    is a replica; every rank still writes its own checkpoint file. Returns this rank's totals.
    """
    p, rank, world = job.preset, backend.rank, backend.world_size
    if job.arm.kind == ALONE and world != 1:
        raise ValueError(f"the alone arm trains on a world of one, not {world} workers")
    file_rank, file_world = (hybrid.rank, hybrid.world_size) if hybrid is not None else (rank, world)
    device = torch.device(p.device)
    autocast = p.autocast == "bf16"
    model = build_model(p.model_config(job.vocab_size), seed=job.seed)
    model.load_state_dict(job.init_state)  # identical replicas, whatever the thread interleaving
    model.to(device).train()
    if hybrid is not None:
        shard_model(model, model.blocks, hybrid)
    if job.arm.kind in PEER_KINDS:  # their own code; the loss goes through their module (DDP)
        opt = build_peer_optimizer(job.arm.kind, model, optimizer_kwargs(job.arm, p), backend)
        forward = opt.forward_module
        warmup = None
    else:
        opt, forward = build_optimizer(job.arm, model.named_parameters(), p, backend), model
        warmup = compression_warmup(job.arm.options, opt)  # before a restore: it keeps the groups' own settings
    base_lrs = [g["lr"] for g in opt.param_groups]
    store = CheckpointStore(job.out, job.arm.slug, job.seed, file_world)
    state = {"step": 0, **dict.fromkeys(COUNTERS, 0), "wall_s": 0.0, **dict.fromkeys(_WARMUP_LEDGER, 0)}
    if job.resume and (step := store.latest_step()) > 0:
        state = {**state, **store.restore(step, file_rank, model, opt)}
    if warmup is not None:
        warmup.load_state_dict({**warmup.state_dict(), "last_step": state["step"]})
    val = (
        val_batches(job.corpus.val, n_batches=p.eval_batches, batch_size=p.eval_batch_size, seq_len=p.seq_len)
        if rank == 0
        else None
    )
    tokens_per_step = world * p.batch_size * p.seq_len
    if rank == 0 and state["step"] == 0:
        val_loss = evaluate(model, val, device, autocast, opt)  # every shard of worker 0 takes part
    if sink is not None and state["step"] == 0:
        sink.row(
            step=0,
            train_loss=None,
            val_loss=val_loss,
            lr=0.0,
            tokens=0,
            sent=0,
            received=0,
            state=state,
            times=(0.0, 0.0, 0.0, 0.0),
        )
    last = _counters(backend, opt)
    status = "done"
    for step in range(state["step"] + 1, p.steps + 1):
        if stop is not None and stop.should_stop(step):
            status = "interrupted"
            break
        t_start = time.perf_counter()
        factor = lr_factor(step, p.steps, p.warmup_steps, p.min_lr_ratio)
        for g, base in zip(opt.param_groups, base_lrs):
            g["lr"] = base * factor
        x, y = worker_batch(
            job.corpus.train,
            step=step,
            rank=rank,
            world_size=world,
            batch_size=p.batch_size,
            seq_len=p.seq_len,
            seed=job.seed,
            sharding=p.sharding,
        )
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = forward(x.to(device), y.to(device))
        loss.backward()
        losses.put(step, rank, float(loss.detach()))  # before the collective: see LossTable
        compute_s = time.perf_counter() - t_start
        if job.arm.kind == ALONE:  # no network: its own gradient, as one machine would train
            codec_s = comm_s = 0.0
            clip_gradients(model, p.grad_clip)
            opt.step()
        elif job.arm.kind == "adamw":
            t0 = time.perf_counter()
            comm_s = _all_reduce_gradients(model, backend)
            codec_s = time.perf_counter() - t0 - comm_s
            clip_gradients(model, p.grad_clip)
            opt.step()
        else:
            clip_gradients(model, p.grad_clip)  # this worker's own gradient, before it is compressed
            payload_nbytes = opt.payload_nbytes if warmup is not None else 0  # this step's size
            opt.step()
            codec_s, comm_s = opt.last_step_timing["codec_s"], opt.last_step_timing["comm_s"]
        opt.zero_grad(set_to_none=True)
        checkpoint_now = step % p.checkpoint_every == 0 and step < p.steps
        if (checkpoint_now or step == p.steps) and hasattr(opt, "flush"):
            # Overlap mode: land the pending update (and count its bytes) before evaluating or saving.
            opt.flush()
        collectives_before = state["collectives"]
        state, sent, received, last = _count_bytes(backend, opt, state, last, step)
        if warmup is not None:  # the payload's size changes: the ledger adds up this step's
            warmup.step()
            state = _add_to_warmup_ledger(state, payload_nbytes, state["collectives"] - collectives_before, world)
        train_loss = losses.mean(step, world)
        eval_s, val_loss = 0.0, None
        if rank == 0 and (step % p.eval_every == 0 or step == p.steps):
            t0 = time.perf_counter()
            val_loss = evaluate(model, val, device, autocast, opt)
            eval_s = time.perf_counter() - t0
        state["wall_s"] += time.perf_counter() - t_start
        if sink is not None:
            sink.row(
                step=step,
                train_loss=train_loss,
                val_loss=val_loss,
                lr=opt.param_groups[0]["lr"],
                tokens=step * tokens_per_step,
                sent=sent,
                received=received,
                state=state,
                times=(compute_s, codec_s, comm_s, eval_s),
            )
        if checkpoint_now and saves:
            store.save(file_rank, step, model, opt, state)
    if status == "interrupted" and saves and state["step"] > 0 and not getattr(opt, "overlap", False):
        # Overlap mode is left to its last periodic checkpoint: saving now would flush the pending
        # update a step early, and the resumed run would then differ from an uninterrupted one.
        store.save(file_rank, state["step"], model, opt, state)
    payload = 0 if job.arm.kind == ALONE else getattr(opt, "payload_nbytes", None)
    if payload is None:  # AdamW: the flat fp32 gradient is what each worker puts into the all-reduce
        # the optimizer's parameters: FSDP2 leaves the model's root unsharded after a forward pass
        payload = 4 * sum(local(q).numel() for g in opt.param_groups for q in g["params"] if q.requires_grad)
    expected = getattr(opt, "expected_sent_bytes", None)
    ledger = {k: state[k] for k in _WARMUP_LEDGER} if warmup is not None else {}
    return {
        **({"expected_sent_bytes": expected(state["step"])} if expected is not None else {}),
        **ledger,
        "rank": file_rank,
        "world_size": world,
        "status": status,
        "step": state["step"],
        **{k: state[k] for k in COUNTERS},
        "wall_s": state["wall_s"],
        "payload_nbytes": int(payload),
        "n_params": sum(q.numel() for q in model.parameters()),
    }
