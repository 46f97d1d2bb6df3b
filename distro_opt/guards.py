"""Set-ups that run but do not train what the user meant, caught when training starts
(``TrainingStart``, one per optimizer).

* Which backend. ``comm=None`` is resolved at the first step (or the first read of ``opt.comm``),
  not at construction: trainers build the optimizer before they start the process group.
* A DDP or FSDP1 wrapper all-reducing the same gradients: warned of once (``wrappers.py``).

* Replicas that differ. Every worker applies the same aggregated update, so workers that start from
  different parameters (a per-rank seed, a checkpoint loaded on one rank only) train different
  models without any error. At its first step, and at the first step after ``load_state_dict``,
  the optimizer all-gathers an 8-byte checksum of its trainable parameters (each rank's local shard
  of a DTensor) and every worker raises the same ``ValueError`` when they differ: all of them see
  the same gathered list. Only through a backend whose ``compares_replicas`` is set (``Backend``).
* One worker that still compresses. With a world of one the step still keeps only the top-k
  coefficients per chunk in a few bits, the rest waiting in the error-feedback buffer, so a first
  single-process test trails AdamW; a one-time notice says so when the backend is resolved.
"""
from __future__ import annotations

import hashlib

import torch

from distro_opt.comm import Backend, CommStats, check_comm, resolve_backend
from distro_opt.comm.base import warn_at_caller

from . import shards, wrappers

CHECKSUM_NBYTES = 8  # what each worker contributes to the replica check


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

    def check(self, comm: Backend, params, replicas) -> None:
        """With several workers: warn of a wrapper all-reducing ``params``' gradients (once), and
        compare ``replicas`` (the parameters, or what the workers agree on in their place) where the
        backend asks for it. Nothing is sent with one worker."""
        if comm.world_size > 1 and self._wrappers_due:
            found = wrappers.gradient_syncing_wrappers(params, comm)
            if found:
                warn_at_caller(wrappers.warning_text(found, self._name))
        if comm.world_size > 1 and self.replicas_due and comm.compares_replicas:
            check_replicas(comm, replicas, self.replica_check_stats)
        self._wrappers_due = self.replicas_due = False


def parameter_checksum(params) -> bytes:
    """``CHECKSUM_NBYTES`` of BLAKE2b over every parameter's shape, dtype and bytes, in order (a
    DTensor's local shard: the replicas of one shard hold the same bytes)."""
    digest = hashlib.blake2b(digest_size=CHECKSUM_NBYTES)
    for p in params:
        t = shards.local(p).detach()
        digest.update(f"{tuple(t.shape)} {t.dtype};".encode())
        digest.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


def check_replicas(comm, params, stats) -> None:
    """All-gather this worker's parameter checksum through ``comm``; raise the same ``ValueError``
    on every worker when the checksums differ. The bytes the check moved (as ``comm.stats``
    counted them) are recorded in ``stats`` (a ``CommStats``), one collective per check."""
    mine = torch.frombuffer(bytearray(parameter_checksum(params)), dtype=torch.uint8)
    sent0, received0 = comm.stats.bytes_sent, comm.stats.bytes_received
    bufs = comm.all_gather(mine)
    stats.record(comm.stats.bytes_sent - sent0, comm.stats.bytes_received - received0)
    seen = [bytes(b.cpu().tolist()).hex() for b in bufs]
    if len(set(seen)) > 1:
        raise ValueError(
            "the workers hold different parameters (values, shapes or order; checksums: "
            + ", ".join(f"rank {r}: {c}" for r, c in enumerate(seen))
            + f"; seen by rank {comm.rank}). Every worker applies the same update, so replicas that "
            "start apart stay apart: build the model with the same seed on every rank, or broadcast "
            "rank 0's parameters before the first step (torch.distributed.broadcast(p.data, src=0) "
            "for each parameter and buffer), and load a checkpoint on every rank alike."
        )


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
