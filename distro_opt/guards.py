"""Set-ups that run but do not train what the user meant, caught when training starts
(``TrainingStart``, one per optimizer).

* Which backend. ``comm=None`` is resolved at the first step (or the first read of ``opt.comm``),
  not at construction: trainers build the optimizer before they start the process group.
* A DDP or FSDP1 wrapper all-reducing the same gradients: warned of once (``wrappers.py``).

* Replicas that differ. Every worker applies the same aggregated update, so workers that start from
  different parameters (a per-rank seed, a checkpoint loaded on one rank only) train different
  models without any error, and workers whose settings differ (another lr, betas or compression
  setting on one rank) apply different updates to the same model. At its first step, and at the
  first step after ``load_state_dict``, the optimizer all-gathers ``CHECKSUM_NBYTES`` per worker:
  an 8-byte checksum of its trainable parameters (each rank's local shard of a DTensor) and one of
  its settings (every param group's hyperparameters, and the optimizer's own: ``settings_of``;
  the settings that shape the payload are compared by every payload's header), and every worker raises the same ``ValueError`` when either differs: all of them see the same
  gathered list. Only through a backend whose ``compares_replicas`` is set (``Backend``).
* One worker that still compresses. With a world of one the step still keeps only the top-k
  coefficients per chunk in a few bits, the rest waiting in the error-feedback buffer, so a first
  single-process test trails AdamW; a one-time notice says so when the backend is resolved.
"""
from __future__ import annotations

import hashlib
import numbers

import torch

from distro_opt.comm import Backend, CommStats, check_comm, resolve_backend
from distro_opt.comm.base import warn_at_caller

from . import shards, wrappers

DIGEST_NBYTES = 8
CHECKSUM_NBYTES = 2 * DIGEST_NBYTES  # what each worker contributes: its parameters', its settings' digest


class TrainingStart:
    """An optimizer's backend, resolved at first use, and the checks due when training starts.

    ``comm``/``process_group``: as the optimizer was given them (checked now: a wrong type fails at
    construction). A backend this did not build (``None``, a ``ProcessGroup``) that turns out to be a
    world of one gets the single-worker notice when it is resolved; a ``Backend`` the user built is
    taken as meant."""

    def __init__(self, optimizer_name: str, comm=None, process_group=None):
        target = check_comm(comm, process_group)
        self._name = optimizer_name
        self._target = target
        self._backend: Backend | None = target if isinstance(target, Backend) else None
        self.replica_check_stats = CommStats()
        self.replicas_due = True  # at the first step, and again after each load_state_dict
        self._wrappers_due = True  # at the first step only

    def backend(self, layout) -> Backend:
        """The backend; ``layout()`` gives the payload layout, read only for the notice."""
        if self._backend is None:
            self._backend = resolve_backend(self._target)
            if self._backend.world_size == 1:
                notice_single_worker(self._name, layout())
        return self._backend

    @property
    def checks_due(self) -> bool:
        return self.replicas_due or self._wrappers_due

    def check(self, comm: Backend, params, replicas, settings=()) -> None:
        """With several workers: warn of a wrapper all-reducing ``params``' gradients (once), and
        compare ``replicas`` (the parameters, or what the workers agree on in their place) and
        ``settings`` (``settings_of``) where the backend asks for it. Nothing is sent with one worker."""
        if comm.world_size > 1 and self._wrappers_due:
            found = wrappers.gradient_syncing_wrappers(params, comm)
            if found:
                warn_at_caller(wrappers.warning_text(found, self._name))
        if comm.world_size > 1 and self.replicas_due and comm.compares_replicas:
            check_replicas(comm, replicas, self.replica_check_stats, settings)
        self._wrappers_due = self.replicas_due = False


# Settings that shape the payload: its header's layout fingerprint carries them, so workers that
# differ there already fail every step's exchange alike (PayloadError, "layout mismatch").
LAYOUT_KEYS = ("compression_topk", "compression_chunk", "compression_bits")


def settings_of(param_groups, **optimizer_settings) -> list:
    """What the workers must agree on besides the parameters, in a form that is the same on every
    worker that was given the same values: each group's settings but its params and ``LAYOUT_KEYS``
    (numbers as floats, so lr=1 and lr=1.0 agree; tensors by their values, not their device), then
    ``optimizer_settings``. An object of no known kind counts by its type (its repr may hold a
    memory address)."""
    groups = [{k: v for k, v in g.items() if k not in ("params", *LAYOUT_KEYS)} for g in param_groups]
    return [_canonical(g) for g in groups] + [_canonical(optimizer_settings)]


def _canonical(value):
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if torch.is_tensor(value):
        return _canonical(value.detach().cpu().tolist())
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    return f"<{type(value).__qualname__}>"


def settings_checksum(settings) -> bytes:
    """``DIGEST_NBYTES`` of BLAKE2b over ``settings`` (``settings_of``)."""
    return hashlib.blake2b(repr(settings).encode(), digest_size=DIGEST_NBYTES).digest()


def parameter_checksum(params) -> bytes:
    """``DIGEST_NBYTES`` of BLAKE2b over every parameter's shape, dtype and bytes, in order (a
    DTensor's local shard: the replicas of one shard hold the same bytes)."""
    digest = hashlib.blake2b(digest_size=DIGEST_NBYTES)
    for p in params:
        t = shards.local(p).detach()
        digest.update(f"{tuple(t.shape)} {t.dtype};".encode())
        digest.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


def check_replicas(comm, params, stats, settings=()) -> None:
    """All-gather this worker's parameter checksum and settings checksum through ``comm``; raise the
    same ``ValueError`` on every worker when either differs. The bytes the check moved (as
    ``comm.stats`` counted them) are recorded in ``stats`` (a ``CommStats``), one collective per check."""
    mine = parameter_checksum(params) + settings_checksum(settings)
    sent0, received0 = comm.stats.bytes_sent, comm.stats.bytes_received
    bufs = comm.all_gather(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    stats.record(comm.stats.bytes_sent - sent0, comm.stats.bytes_received - received0)
    seen = [bytes(b.cpu().tolist()) for b in bufs]
    problems = []
    if len({s[DIGEST_NBYTES:] for s in seen}) > 1:
        problems.append(
            "the workers' optimizer settings differ (a param group's lr, betas, eps, weight_decay, "
            "compression_decay or update, their number of param groups, or the optimizer's own "
            "error_feedback, overlap or sync_every; checksums: "
            + ", ".join(f"rank {r}: {s[DIGEST_NBYTES:].hex()}" for r, s in enumerate(seen))
            + "). Every worker must apply the same update: give every rank the same hyperparameters "
            "(a scheduler alike on every rank, and a checkpoint loaded on every rank alike)."
        )
    if len({s[:DIGEST_NBYTES] for s in seen}) > 1:
        problems.append(
            "the workers hold different parameters (values, shapes or order; checksums: "
            + ", ".join(f"rank {r}: {s[:DIGEST_NBYTES].hex()}" for r, s in enumerate(seen))
            + "). Every worker applies the same update, so replicas that "
            "start apart stay apart: build the model with the same seed on every rank, or broadcast "
            "rank 0's parameters before the first step (torch.distributed.broadcast(p.data, src=0) "
            "for each parameter and buffer), and load a checkpoint on every rank alike."
        )
    if problems:
        raise ValueError(" ".join(problems) + f" (seen by rank {comm.rank})")


def compresses(layout) -> bool:
    """Whether a step drops or rounds anything: some parameter keeps fewer coefficients than its
    chunk holds, or sends its values in fewer than 32 bits."""
    return any(spec.k < spec.chunk_numel or spec.bits < 32 for spec in layout.specs)


def notice_single_worker(name: str, layout) -> None:
    """The one-time notice of a world of one whose steps still compress (see the module docstring)."""
    if not compresses(layout):
        return
    warn_at_caller(
        f"distro-opt: {name} runs as a single worker (no torch.distributed process group, or a group "
        "of one) and still compresses: each step applies only the top compression_topk DCT "
        "coefficients of each chunk in compression_bits bits, the rest waiting in the error-feedback "
        "buffer, so it trails torch.optim.AdamW. For a single-process baseline use torch.optim.AdamW "
        "(compression_topk = compression_chunk**2 with compression_bits=32 sends every coefficient "
        "exactly, but the update rule still is not AdamW's). To train on several workers, start them with "
        "torchrun and call torch.distributed.init_process_group() before the first step."
    )
