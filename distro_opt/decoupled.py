"""The step shared by DeMo and DisTrOAdamW: decoupled momentum, compression, one all-gather, aggregate.

Per parameter p with gradient g (DeMo, arXiv 2411.19870, Algorithm 1), in the DCT domain:

    Delta <- beta * Delta + s * DCT(g)              (beta = compression_decay; s = lr for DeMo, 1 else)
    q     <- top-k per chunk of Delta, quantized     (what is sent)
    Delta <- Delta - q                              (error feedback: the sender keeps what it did not send)
    Q     <- mean over the workers that kept each coefficient of their q   (after the all-gather)
    p     <- update(p, IDCT(Q))                      (subclass: sign step, or an Adam-normalized step)

Because the DCT is orthonormal, keeping Delta in the DCT domain is the same algorithm as the reference's
spatial-domain buffer, and saves one inverse transform per step. Every payload (the worker's own
included) is decoded from the gathered bytes, so all workers apply bit-identical updates.
"""
from __future__ import annotations

import math
import time
import warnings

import torch

from distro_opt.comm import resolve_backend

from .codec import PayloadLayout, aggregate, param_spec
from .quant import PayloadError, value_codec
from .select import topk_abs_in_runs, topk_abs_indices
from .transform import DCTTransform

# The forward transform batches neighbouring same-shape tensors up to this many elements (its
# workspace holds one batch: 64 MB in float32).
RUN_NUMEL = 1 << 24
# Top-k works on runs along the last axis of a chunk when they are at least this long; shorter ones
# are copied to chunk-major rows first.
MIN_RUN = 16
# How state[p]["delta"] is laid out (see state_dict).
DELTA_LAYOUT = "tensor"


def layout_rows(seg, run) -> tuple[int, int]:
    """The stack rows (chunks) that the neighbouring members ``run`` of ``seg`` occupy."""
    return seg.rows[seg.members.index(run[0])][0], seg.rows[seg.members.index(run[-1])][1]


def check_hyperparameters(lr, weight_decay, compression_decay, compression_topk, compression_chunk, compression_bits):
    """torch-style validation (``not 0.0 <= x`` so that NaN is rejected too)."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not 0.0 <= compression_decay < 1.0:
        raise ValueError(f"Invalid compression_decay value: {compression_decay}")
    if not (isinstance(compression_topk, int) and compression_topk >= 1):
        raise ValueError(f"Invalid compression_topk value: {compression_topk}")
    if not (isinstance(compression_chunk, int) and compression_chunk >= 1):
        raise ValueError(f"Invalid compression_chunk value: {compression_chunk}")
    value_codec(compression_bits)


class DecoupledMomentumOptimizer(torch.optim.Optimizer):
    """Base class: subclasses choose the momentum input scale and the final update."""

    # A step that nobody contributed to is skipped on every worker alike (False: apply it anyway).
    _skip_empty_steps = True
    # GradScaler hands us grad_scale/found_inf instead of skipping step() on one worker only:
    # a skipped step would leave the other workers waiting in the collective.
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults, comm=None, process_group=None, overlap=False):
        super().__init__(params, defaults)
        self.comm = resolve_backend(comm, process_group)
        self.overlap = bool(overlap)
        self.last_step_timing = {"codec_s": 0.0, "comm_s": 0.0}
        self._transform = DCTTransform()
        self._layouts: dict[tuple, PayloadLayout] = {}
        self._stacks: dict[int, list[torch.Tensor]] = {}  # per segment: two momentum buffers in turn
        self._run_tables: dict[tuple, torch.Tensor] = {}
        self._pending = None

    def add_param_group(self, param_group) -> None:
        """As torch's, then the group's own settings are validated like the constructor's, so a bad
        per-group value fails here rather than silently doing something else at the first step."""
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    def _check_group(self, group) -> None:
        check_hyperparameters(
            group["lr"], group["weight_decay"], group["compression_decay"], group["compression_topk"],
            group["compression_chunk"], group["compression_bits"],
        )

    # -- hooks -----------------------------------------------------------------------------------
    def _momentum_scale(self, group) -> float:
        raise NotImplementedError

    def _update(self, group, p, direction: torch.Tensor, state) -> None:
        """Apply the aggregated direction to ``p`` (weight decay included).

        ``direction`` comes in the transform's blocked layout (see ``DCTTransform.decode_many``);
        ``p`` and its state tensors line up with it through ``self._view(t, direction)``."""
        raise NotImplementedError

    @staticmethod
    def _view(t: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """A parameter (or a parameter-shaped state tensor) viewed in ``direction``'s shape, no copy."""
        return t.view(direction.shape)

    @staticmethod
    def _weight_decay(group, p) -> None:
        """Decoupled weight decay, p *= 1 - lr * wd (skipped when wd = 0: no pass over p)."""
        if group["weight_decay"] != 0:
            p.mul_(1 - group["lr"] * group["weight_decay"])

    @staticmethod
    def _sign_step(group, p, direction) -> None:
        """DeMo's update: p -= lr * sign(direction). ``direction`` is this step's own scratch tensor,
        so its sign is taken in place."""
        direction.sign_()
        p.add_(direction if direction.dtype == p.dtype else direction.to(p.dtype), alpha=-group["lr"])

    def _communicates_this_step(self, entries) -> bool:
        """False for a step that stays local (the local-step mode's inner steps)."""
        return True

    # -- layout ----------------------------------------------------------------------------------
    def _entries(self):
        return [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _layout(self, entries) -> PayloadLayout:
        key = tuple(
            (tuple(p.shape), g["compression_topk"], g["compression_chunk"], g["compression_bits"])
            for g, p in entries
        )
        if key not in self._layouts:
            self._layouts[key] = PayloadLayout([param_spec(*k) for k in key])
        return self._layouts[key]

    @property
    def payload_layout(self) -> PayloadLayout:
        """The wire layout of this worker's payload; ``payload_layout.decode(buf)`` validates one."""
        return self._layout(self._entries())

    @property
    def payload_nbytes(self) -> int:
        """Bytes this worker sends per collective (the buffer's size), known before any step."""
        return self.payload_layout.nbytes

    # -- step ------------------------------------------------------------------------------------
    @staticmethod
    def _work_dtype(p):
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def _state(self, p, spec):
        state = self.state[p]
        if "delta" not in state:
            state["step"] = torch.tensor(0.0)
            state["delta"] = torch.zeros(p.shape, dtype=self._work_dtype(p), device=p.device)
        return state

    def _inputs(self, entries) -> list[torch.Tensor | None]:
        """What each parameter feeds into its momentum this step: its gradient (None: no gradient)."""
        return [p.grad for _, p in entries]

    def _scaler_found_inf(self) -> bool:
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            warnings.warn("distro-opt: GradScaler found inf/NaN gradients; this worker contributes nothing this step")
            return True
        return False

    def _compress(self, entries, layout, inputs):
        """Momentum update, top-k, quantization and error feedback, without touching the state.

        Returns (None, None) when an input is not finite. A NaN or inf anywhere in a chunk spreads
        to all of that chunk's coefficients, and top-k ranks NaN and inf first, so checking the kept
        values finds it without another pass over the gradients."""
        grad_scale = getattr(self, "grad_scale", None)
        unscale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        parts, news = [], [None] * len(entries)
        finite = True
        for j, seg in enumerate(layout.segments):
            deltas = [self._state(entries[m][1], layout.specs[m])["delta"] for m in seg.members]
            stack = self._spare_stack(j, seg, deltas)
            old = self._old_stack(j, seg, deltas, stack)
            n = seg.chunk_numel
            for run in self._runs(entries, layout, seg):  # new = decay * Delta + scale * DCT(g), a batched GEMM per run
                group = entries[run[0]][0]
                xs = [self._input(entries[m][1], inputs[m], stack.dtype) for m in run]
                a, b = layout_rows(seg, run)
                self._transform.accumulate(
                    xs, seg.chunk, old[a * n : b * n], stack[a * n : b * n],
                    decay=group["compression_decay"], scale=self._momentum_scale(group) * unscale,
                )
            idx, kept, feedback = self._select(layout, j, seg, stack)
            finite &= bool(torch.isfinite(kept).all())
            vbytes, sent = value_codec(seg.bits).encode(kept)
            feedback(sent)  # error feedback: keep what was not sent
            parts.append((idx, vbytes))
            for m, d, (start, end) in zip(seg.members, deltas, seg.rows):
                new = stack[start * n : end * n].view(d.shape)
                news[m] = new if new.dtype == d.dtype else new.to(d.dtype)  # a view unless the segment mixes dtypes
        if not finite:
            warnings.warn("distro-opt: non-finite local gradient; this worker contributes nothing this step")
            return None, None
        return parts, news

    @staticmethod
    def _input(p, x, dtype) -> torch.Tensor:
        if x is None:
            return torch.zeros(p.shape, dtype=dtype, device=p.device)
        return x if x.dtype == dtype else x.to(dtype)

    @staticmethod
    def _runs(entries, layout, seg) -> list[list[int]]:
        """The segment's members cut into runs of neighbours with one shape and one param group, at
        most RUN_NUMEL elements each (the forward workspace holds one run): one batched GEMM each."""
        runs, numel = [], 0
        for m in seg.members:
            size = math.prod(layout.specs[m].shape)
            prev = runs[-1][-1] if runs else None
            if (
                prev is not None
                and layout.specs[prev].shape == layout.specs[m].shape
                and entries[prev][0] is entries[m][0]
                and numel + size <= RUN_NUMEL
            ):
                runs[-1].append(m)
                numel += size
            else:
                runs.append([m])
                numel = size
        return runs

    def _select(self, layout, j, seg, stack):
        """Top-k per chunk of the segment's new momentum (kept in each tensor's own layout).

        Returns (indices within each chunk, chunk-major, as they travel; the kept values; a function
        that subtracts what was sent from the momentum)."""
        k, n = seg.k, seg.chunk_numel
        run_rows = self._run_rows(layout, j, seg, stack.device)
        if run_rows is None:
            rows = stack.view(-1, n)  # every chunk is already a contiguous row
            idx = topk_abs_indices(rows, k)
            return idx, rows.gather(1, idx), lambda sent: rows.scatter_add_(1, idx, -sent)
        if seg.chunk[-1] >= MIN_RUN:  # chunks scattered over rows: top-k over runs along the last axis
            idx, pos = topk_abs_in_runs(stack.view(-1, seg.chunk[-1]), run_rows, k)
            return idx, stack[pos], lambda sent: stack.index_add_(0, pos.view(-1), sent.view(-1), alpha=-1)
        # short runs: copy to chunk-major rows and back
        shapes = [layout.specs[m].shape for m in seg.members]
        pieces = [(stack[a * n : b * n].view(s), a, b) for s, (a, b) in zip(shapes, seg.rows)]
        rows = torch.cat([self._transform.chunk_major(x, seg.chunk).reshape(-1, n) for x, _, _ in pieces])
        idx = topk_abs_indices(rows, k)

        def feedback(sent):
            rows.scatter_add_(1, idx, -sent)
            for x, a, b in pieces:
                x.view(self._transform.blocked_shape(x.shape, seg.chunk)).copy_(
                    self._transform.blocked(rows[a:b], tuple(x.shape) or (1,), seg.chunk)
                )

        return idx, rows.gather(1, idx), feedback

    def _run_rows(self, layout, j, seg, device) -> torch.Tensor | None:
        """Segment ``j``'s ``DCTTransform.run_rows`` tables back to back (cached), or None when every
        member's own layout already lists its chunks as rows."""
        key = (id(layout), j, device)
        if key not in self._run_tables:
            if all(self._transform.own_layout_is_chunk_major(layout.specs[m].shape, seg.chunk) for m in seg.members):
                self._run_tables[key] = None
                return None
            if seg.chunk[-1] < MIN_RUN:  # the copy path needs no table
                self._run_tables[key] = torch.empty(0)
                return self._run_tables[key]
            tables, offset = [], 0
            for m, (a, b) in zip(seg.members, seg.rows):
                tables.append(self._transform.run_rows(layout.specs[m].shape, seg.chunk) + offset)
                offset += (b - a) * seg.chunk_numel // seg.chunk[-1]
            self._run_tables[key] = torch.cat(tables).to(device)
        return self._run_tables[key]

    def _spare_stack(self, j, seg, deltas) -> torch.Tensor:
        """Segment ``j``'s flat buffer for this step's new momentum: its members back to back, each
        in its tensor's own layout.

        Two buffers per segment take turns: the state holds views of one (the momentum committed
        last step) while the step writes the other, so nothing in the state changes before the
        step commits, and no step allocates (and page-faults) a model-sized tensor."""
        dtype = deltas[0].dtype
        for d in deltas[1:]:
            dtype = torch.promote_types(dtype, d.dtype)
        shape, device = (seg.num_chunks * seg.chunk_numel,), deltas[0].device
        in_use = {d.untyped_storage().data_ptr() for d in deltas}
        pair = self._stacks.get(j)
        if (
            pair is None
            or (pair[0].shape, pair[0].dtype, pair[0].device) != (shape, dtype, device)
            or all(buf.untyped_storage().data_ptr() in in_use for buf in pair)
        ):  # fresh buffers: no state tensor can be a view of them
            pair = self._stacks[j] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
        return next(buf for buf in pair if buf.untyped_storage().data_ptr() not in in_use)

    def _old_stack(self, j, seg, deltas, spare) -> torch.Tensor:
        """The committed momentum as one flat buffer: the other buffer of the pair when the state
        holds its views in order (every step but the first, or one after loading), else a copy."""
        other = next((buf for buf in self._stacks[j] if buf is not spare), None)
        n = seg.chunk_numel
        if other is not None and other.dtype == spare.dtype and all(
            d.dtype == other.dtype and d.data_ptr() == other.data_ptr() + a * n * other.element_size() and d.is_contiguous()
            for d, (a, _) in zip(deltas, seg.rows)
        ):
            return other
        return torch.cat([d.reshape(-1).to(spare.dtype) for d in deltas])

    def _decode_all(self, layout, bufs):
        decoded = []
        drops = getattr(self.comm, "drops_invalid_payloads", False)
        for i, buf in enumerate(bufs):
            try:
                payload = layout.decode(buf)
            except PayloadError as exc:
                if not drops:
                    raise PayloadError(f"payload of worker {i} rejected: {exc}") from None
                warnings.warn(f"distro-opt: dropped invalid payload {i}: {exc}")
                self.comm.report_invalid(i)
                continue
            if payload is not None:
                decoded.append(payload)
        return decoded

    def _apply(self, entries, layout, decoded):
        if not decoded and self._skip_empty_steps:  # nobody contributed: skipped on every worker alike
            return
        for j, seg in enumerate(layout.segments):
            params = [entries[m][1] for m in seg.members]
            states = [self._state(p, layout.specs[m]) for p, m in zip(params, seg.members)]
            if decoded:
                idx, weights = aggregate(seg, [d[j] for d in decoded], like=states[0]["delta"])
                pieces = [(a, b, tuple(p.shape)) for p, (a, b) in zip(params, seg.rows)]
                directions = self._transform.decode_many(idx, weights, seg.chunk, pieces)
            else:
                directions = [
                    torch.zeros(self._transform.blocked_shape(p.shape, seg.chunk), dtype=st["delta"].dtype, device=p.device)
                    for p, st in zip(params, states)
                ]
            torch._foreach_add_([st["step"] for st in states], 1.0)  # applied updates: the same count on every worker
            for m, p, state, direction in zip(seg.members, params, states, directions):
                if not p.is_contiguous():  # no blocked view of p: bring the direction to p's layout
                    direction = direction.reshape(p.shape)
                self._update(entries[m][0], p, direction, state)

    def _finish(self, pending, before_apply=None):
        """Wait for a started collective, validate every payload, then (and only then) write."""
        handle, entries, layout = pending
        t0 = time.perf_counter()
        bufs = handle.wait()
        t1 = time.perf_counter()
        decoded = self._decode_all(layout, bufs)
        if before_apply is not None:
            before_apply()
        self._apply(entries, layout, decoded)
        return t1 - t0, time.perf_counter() - t1

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        entries = self._entries()
        if not self._communicates_this_step(entries):
            self.last_step_timing = {"codec_s": 0.0, "comm_s": 0.0}
            return loss
        layout = self._layout(entries)
        if self._scaler_found_inf():
            parts, deltas = None, None
        else:
            parts, deltas = self._compress(entries, layout, self._inputs(entries))
        buf = layout.encode(parts)
        codec_s = time.perf_counter() - t0

        def commit():
            for (_, p), spec, new in zip(entries, layout.specs, deltas or []):
                state = self._state(p, spec)
                state["delta"] = new

        if self.overlap:  # step t's collective travels while step t+1 computes; its update lands then
            commit()
            previous, self._pending = self._pending, (self.comm.start_all_gather(buf), entries, layout)
            comm_s, apply_s = self._finish(previous) if previous is not None else (0.0, 0.0)
        else:
            pending = (self.comm.start_all_gather(buf), entries, layout)
            comm_s, apply_s = self._finish(pending, before_apply=commit)
        self.last_step_timing = {"codec_s": codec_s + apply_s, "comm_s": comm_s}
        return loss

    @torch.no_grad()
    def flush(self) -> None:
        """Overlap mode: wait for the last collective and apply its update (a no-op otherwise)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(pending)

    def state_dict(self):
        """As torch's, after ``flush()`` so that no started update is lost from the checkpoint.

        In overlap mode this applies the pending update now rather than at the next step, so a run
        that saves at step t follows a (slightly) different path than one that does not; resuming
        from the checkpoint reproduces the saving run exactly.

        ``state[p]["delta"]`` (the error-feedback momentum, DCT domain) has ``p``'s shape: element
        [i, j] of a 2-D one is coefficient (i mod c_1, j mod c_2) of chunk (i // c_1, j // c_2).
        The ``delta_layout`` entry says so; checkpoints without it (distro-opt before it) kept one
        (chunks, coefficients) row per chunk and are converted on loading."""
        self.flush()
        sd = super().state_dict()
        sd["delta_layout"] = DELTA_LAYOUT
        return sd

    def load_state_dict(self, state_dict):
        """As torch's, but buffers keep their saved dtype: torch would cast them to the parameter's
        dtype, and a bf16 model's float32 error-feedback buffer would lose its low bits."""
        state_dict = dict(state_dict)
        delta_layout = state_dict.pop("delta_layout", "chunk rows")
        if delta_layout not in (DELTA_LAYOUT, "chunk rows"):
            raise ValueError(f"checkpoint has an unknown delta_layout {delta_layout!r} (expected {DELTA_LAYOUT!r})")
        self._pending = None
        self._stacks = {}  # the loaded momentum may be views of these; start from fresh buffers
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        chunk_target = {id(p): g["compression_chunk"] for g in self.param_groups for p in g["params"]}
        for index, saved in state_dict["state"].items():
            if isinstance(index, int) and index < len(params):
                p = params[index]
                state = self.state[p]
                for key, value in saved.items():
                    if torch.is_tensor(value) and key != "step" and state[key].dtype != value.dtype:
                        state[key] = value.to(device=p.device, copy=True)
                if "delta" in state and delta_layout == "chunk rows":
                    shape = tuple(p.shape) or (1,)
                    chunk = self._transform.chunk_shape(shape, chunk_target[id(p)])
                    state["delta"] = self._transform.unchunk(state["delta"], shape, chunk).view(p.shape)
                if "delta" in state and state["delta"].shape != p.shape:
                    raise ValueError(
                        f"checkpoint's delta for parameter {index} has shape {tuple(state['delta'].shape)}, "
                        f"expected the parameter's {tuple(p.shape)}"
                    )
