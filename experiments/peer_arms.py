"""Peer arms: other projects' optimizers, run by their own code under torch.distributed.

* ``demo-peer``: ``pytorch_optimizer.DeMo`` (PyPI ``pytorch-optimizer``; DeMo, Peng et al. 2024,
  arXiv 2411.19870). It all-gathers its sparse DCT coefficients itself (``torch.distributed.all_gather``
  of int64 indices and parameter-dtype values, one pair per device and dtype). The ledger counts
  that payload, ``sum over tensors of chunks x min(topk, chunk size) x (8 + element size)`` bytes,
  as an all-gather (``CommStats.all_gather_bytes``), and every step checks it against DeMo's own
  counters: ``data_transmit`` (what this rank put in) and ``data_receive`` (every rank's buffers).
* ``powersgd``: torch AdamW on a ``DistributedDataParallel`` model whose gradients go through torch's
  PowerSGD communication hook (Vogels et al. 2019, arXiv 1905.13727). For each DDP bucket the hook
  all-reduces the whole bucket for the first ``start_powerSGD_iter`` steps, then three tensors: the
  tensors it leaves uncompressed (1-D ones, and matrices where rank-r factors save too little), P
  (n x r per compressed n x m matrix) and Q (m x r). The ledger counts each as a ring all-reduce
  (``CommStats.ring_all_reduce_bytes``) of the gradient dtype, measured on the bucket the hook is
  handed, before it runs; the summary checks the total against the same sum from the model's shapes.

Their own optimizer classes are imported only when the arm is built (pytorch-optimizer is an extra).
Both are wrapped as ``PeerOptimizer``: the training loop's optimizer interface (param_groups, step,
zero_grad, state_dict, last_step_timing, payload_nbytes), plus the module the forward pass goes through.
"""
from __future__ import annotations

import time

import torch

from distro_opt.comm import CommStats

PEER_KINDS = ("demo-peer", "powersgd")
PEER_ALIASES = {"rank": "matrix_approximation_rank", "start_iter": "start_powerSGD_iter"}
# Each peer arm's options and their types. demo-peer's take distro-opt's names (topk, chunk, decay),
# given to pytorch_optimizer.DeMo under its own (compression_top_k, ...); its other defaults are its own.
_OPTIONS = {
    "demo-peer": {"lr": float, "weight_decay": float, "compression_decay": float, "compression_topk": int,
                  "compression_chunk": int},
    "powersgd": {"lr": float, "eps": float, "weight_decay": float, "matrix_approximation_rank": int,
                 "start_powerSGD_iter": int, "min_compression_rate": float, "use_error_feedback": bool,
                 "warm_start": bool, "bucket_cap_mb": float, "betas": None},
}
_DEMO_NAMES = {"compression_topk": "compression_top_k"}
LAUNCH = (
    "torchrun --standalone --nproc-per-node 2 -m experiments.run --arms {arms} --out OUT "
    "(or the one-machine launch of docs/torch-distributed.md)"
)


def peer_allowed_options(kind: str) -> set[str]:
    return set(_OPTIONS[kind])


def peer_option_type(kind: str, name: str):
    return _OPTIONS[kind].get(name)


def peer_start_error(arms, resume: bool, distributed: bool, shard_degree: int = 1) -> str | None:
    """The one line refusing a start of peer arms that cannot work, else None: in-process (they call
    torch.distributed themselves), with the command that launches them; or with --resume (their
    communication state, DeMo's residual and PowerSGD's error feedback and step count, is not saved)."""
    peers = [a.label for a in arms if a.kind in PEER_KINDS]
    if not peers:
        return None
    if shard_degree > 1:  # DDP and DeMo over the whole world: they know nothing of the mesh
        return f"arm {peers[0]!r} does not run sharded: pass --shard-degree 1 for it"
    if resume:
        return f"arm {peers[0]!r} cannot --resume: its communication state is not checkpointed; run it again"
    if not distributed:
        return (f"arm {peers[0]!r} needs torch.distributed (its own code runs the collectives); launch it "
                f"with {LAUNCH.format(arms=','.join(a.label for a in arms))}")
    return None


def check_peer_options(kind: str, options: dict) -> None:
    """The checks the peers' own constructors would make, before any process group exists."""
    for name in ("lr", "weight_decay", "eps"):
        if name in options and not 0.0 <= options[name]:
            raise ValueError(f"Invalid {name} value: {options[name]}")
    for name in ("compression_topk", "compression_chunk", "matrix_approximation_rank"):
        if name in options and not options[name] >= 1:
            raise ValueError(f"Invalid {name} value: {options[name]} (expected >= 1)")
    if "start_powerSGD_iter" in options and not options["start_powerSGD_iter"] >= 0:
        raise ValueError(f"Invalid start_powerSGD_iter value: {options['start_powerSGD_iter']} (expected >= 0)")
    if "compression_decay" in options and not 0.0 <= options["compression_decay"] < 1.0:
        raise ValueError(f"Invalid compression_decay value: {options['compression_decay']}")


class PeerOptimizer:
    """A peer's optimizer as the training loop drives it. ``forward_module`` is what the loss is
    computed through (the DDP wrapper for powersgd); evaluation uses the plain model."""

    def __init__(self, optimizer, forward_module):
        self.optimizer = optimizer
        self.forward_module = forward_module
        self.last_step_timing = {"codec_s": 0.0, "comm_s": 0.0}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)


def demo_payload_nbytes(params, topk: int, chunk: int) -> int:
    """What pytorch_optimizer.DeMo puts into its all-gathers per step: per tensor, its DCT chunks
    (each dimension split by the package's ``get_smaller_split``) times the kept coefficients, each
    an int64 index and a value of the parameter's dtype."""
    from pytorch_optimizer.optimizer.demo import get_smaller_split

    total = 0
    for p in params:
        splits = [get_smaller_split(s, chunk) for s in p.shape]
        chunks = p.numel() // torch.Size(splits).numel()
        total += chunks * min(topk, torch.Size(splits).numel()) * (8 + p.element_size())
    return total


class DeMoPeerOptimizer(PeerOptimizer):
    """``pytorch_optimizer.DeMo``; its bytes recorded in ``backend.stats`` after each step."""

    def __init__(self, model, options: dict, backend):
        from pytorch_optimizer import DeMo

        kwargs = {_DEMO_NAMES.get(k, k): v for k, v in options.items()}
        opt = DeMo(model.parameters(), **kwargs)
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(opt, model)
        self.payload_nbytes = demo_payload_nbytes(params, opt.compression_top_k, opt.compression_chunk)
        self.backend = backend

    def step(self) -> None:
        t0 = time.perf_counter()
        self.optimizer.step()
        world = self.backend.world_size
        sent, received = self.optimizer.data_transmit, self.optimizer.data_receive
        if sent != self.payload_nbytes or received != world * self.payload_nbytes:
            raise RuntimeError(
                f"pytorch_optimizer.DeMo counted {sent} bytes sent and {received} received; the ledger "
                f"expected {self.payload_nbytes} and {world} x that"
            )
        nbytes = CommStats.all_gather_bytes(self.payload_nbytes, world)
        self.backend.stats.record(nbytes, nbytes)
        # its collectives run inside its step: the step's time is all there is to report
        self.last_step_timing = {"codec_s": 0.0, "comm_s": time.perf_counter() - t0}


def powersgd_elements(shapes, rank: int, min_compression_rate: float) -> tuple[int, int, int]:
    """(uncompressed, P, Q) elements PowerSGD all-reduces per step, once compressing, for gradients of
    ``shapes`` in one bucket: each as an n x m matrix (n = first dimension), compressed to n x r and
    m x r factors where torch's own ``_should_compress`` says it is worth it (never a 1-D tensor)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    plain, p_total, q_total = 0, 0, 0
    for shape in shapes:
        n = shape[0]
        m = torch.Size(shape).numel() // n
        r = min(n, m, rank)
        if len(shape) > 1 and _should_compress(n, m, r, min_compression_rate)[0]:
            p_total, q_total = p_total + n * r, q_total + m * r
        else:
            plain += n * m
    return plain, p_total, q_total


def powersgd_all_reduces(shapes, element_size: int, dense: bool, rank: int, min_compression_rate: float) -> list[int]:
    """The sizes in bytes of the all-reduces PowerSGD runs for one bucket of gradients of ``shapes``
    in one step: the whole bucket while ``dense`` (before ``start_powerSGD_iter``), else the three
    tensors of ``powersgd_elements``."""
    if dense:
        return [element_size * sum(torch.Size(s).numel() for s in shapes)]
    return [element_size * n for n in powersgd_elements(shapes, rank, min_compression_rate)]


def ring_sent_bytes(sizes, world: int) -> int:
    return sum(CommStats.ring_all_reduce_bytes(n, world) for n in sizes)


class PowerSGDPeerOptimizer(PeerOptimizer):
    """torch AdamW on a DDP model with torch's PowerSGD hook; the hook's all-reduces recorded in
    ``backend.stats`` (one record per step) from the buckets it is handed. They run inside the
    backward pass (DDP overlaps them with it), so their time is in the step's compute time."""

    HOOK_KEYS = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                 "use_error_feedback", "warm_start")

    def __init__(self, model, options: dict, backend):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        from torch.nn.parallel import DistributedDataParallel

        self.hook_state = powersgd.PowerSGDState(
            process_group=None, **{k: v for k, v in options.items() if k in self.HOOK_KEYS}
        )
        # no buffer broadcast in each forward pass: the buffers (RoPE tables) are the same on every
        # rank, and it would be traffic outside the ledger
        ddp_keys = {k: v for k, v in options.items() if k == "bucket_cap_mb"}
        ddp = DistributedDataParallel(model, forward_sync_buffers=False, **ddp_keys)
        self._hook = powersgd.powerSGD_hook
        ddp.register_comm_hook(self.hook_state, self._counted_hook)
        adamw_keys = {k: v for k, v in options.items() if k not in (*self.HOOK_KEYS, *ddp_keys)}
        super().__init__(torch.optim.AdamW(model.parameters(), **adamw_keys), ddp)
        self.shapes = [p.shape for p in model.parameters() if p.requires_grad]
        self.backend = backend
        self._step_bytes, self._message_bytes, self._steps = 0, 0, 0
        # Gloo runs the hook's chained all-reduces (P, then Q) from its own threads as each one
        # completes, so two buckets' chains can reach the wire in different orders on different
        # ranks: a collective mismatch (or a hang). Finishing each bucket's chain before DDP hands
        # over the next keeps one order; NCCL enqueues them in call order and needs no wait.
        self._one_bucket_at_a_time = torch.distributed.get_backend() == "gloo"

    def _counted_hook(self, state, bucket):
        shapes, dense = [g.shape for g in bucket.gradients()], state.iter < state.start_powerSGD_iter
        rank, rate = state.matrix_approximation_rank, state.min_compression_rate
        sizes = powersgd_all_reduces(shapes, bucket.buffer().element_size(), dense, rank, rate)
        self._step_bytes += ring_sent_bytes(sizes, self.backend.world_size)
        self._message_bytes += sum(sizes)
        before = state.total_numel_after_compression
        future = self._hook(state, bucket)
        if self._one_bucket_at_a_time:
            future.wait()
        # the hook's own statistic: the elements it all-reduced for this bucket, once compressing
        moved = state.total_numel_after_compression - before
        counted = sum(powersgd_elements(shapes, rank, rate))
        if not dense and moved != counted:
            raise RuntimeError(
                f"torch's PowerSGD hook all-reduced {moved} elements for bucket {bucket.index()}; "
                f"the ledger counted {counted}"
            )
        return future

    def expected_sent_bytes(self, steps: int) -> int:
        """The ledger's total after ``steps`` from the model's shapes alone, as one fp32 bucket (the
        per-bucket rounding of a ring's 2 (N-1)/N can differ by a byte per extra bucket)."""
        state, world = self.hook_state, self.backend.world_size
        dense_steps = min(steps, state.start_powerSGD_iter)
        per_step = [ring_sent_bytes(powersgd_all_reduces(self.shapes, 4, dense, state.matrix_approximation_rank,
                                                         state.min_compression_rate), world)
                    for dense in (True, False)]
        return dense_steps * per_step[0] + (steps - dense_steps) * per_step[1]

    @property
    def payload_nbytes(self) -> int:
        """What a rank put into its all-reduces per step, on average over the steps so far (the
        dense fp32 gradient before the first): PowerSGD's size changes at ``start_powerSGD_iter``."""
        if self._steps == 0:
            return 4 * sum(s.numel() for s in self.shapes)
        return round(self._message_bytes / self._steps)

    def step(self) -> None:
        t0 = time.perf_counter()
        self.optimizer.step()
        self.backend.stats.record(self._step_bytes, self._step_bytes)
        self._step_bytes, self._steps = 0, self._steps + 1
        self.last_step_timing = {"codec_s": time.perf_counter() - t0, "comm_s": 0.0}


def build_peer_optimizer(kind: str, model, options: dict, backend) -> PeerOptimizer:
    return {"demo-peer": DeMoPeerOptimizer, "powersgd": PowerSGDPeerOptimizer}[kind](model, options, backend)
