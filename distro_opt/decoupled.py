"""The step shared by DeMo and DisTrOAdamW: decoupled momentum, compression, one all-gather, aggregate.

Per parameter p with gradient g (DeMo, arXiv 2411.19870, Algorithm 1), in the DCT domain:

    Delta <- beta * Delta + s * DCT(g)              (beta = compression_decay; s = lr for DeMo, 1 else)
    q     <- top-k per chunk of Delta, quantized     (what is sent)
    Delta <- Delta - q                              (error feedback: the sender keeps what it did not send)
    Q     <- mean over the workers that kept each coefficient of their q   (after the all-gather)
    p     <- update(p, IDCT(Q))                      (subclass: sign step, or an Adam-normalized step)

Because the DCT is orthonormal, keeping Delta in the DCT domain is the same algorithm as the reference's
spatial-domain buffer, and saves one inverse transform per step. Delta is kept in each tensor's own
layout (``momentum.py``), where its update is the beta of the DCT's GEMM. Every payload (the worker's
own included) is decoded from the gathered bytes, so all workers apply bit-identical updates.
"""
from __future__ import annotations

import math
import time
import warnings

import torch

from distro_opt.comm import resolve_backend

from .codec import PayloadLayout, aggregate, param_spec
from .kept import kept_tensors
from .quant import PayloadError, value_codec
from .momentum import MomentumStacks, transform_runs
from .transform import DCTTransform

# How state[p]["delta"] is laid out (see state_dict); "chunk rows" is the layout before it.
DELTA_LAYOUT = "tensor"
# State tensors of a parameter's shape (DisTrOAdamW's Adam update and local-step mode add some).
PARAM_SHAPED_STATE = ("delta", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "anchor", "outer_momentum_buffer")


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when ``t`` already has it (a call costs ~1 us even then,
    and a step makes one per parameter several times)."""
    return t if t.dtype == dtype else t.to(dtype)


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


def _check_step(index, step) -> None:
    """A checkpoint's step count: a number or a one-element real tensor, finite and >= 0."""
    if step is None:
        return
    if torch.is_tensor(step):
        ok = step.numel() == 1 and not step.is_complex() and step.dtype != torch.bool
    else:
        ok = isinstance(step, (int, float)) and not isinstance(step, bool)
    if not (ok and math.isfinite(float(step)) and float(step) >= 0):
        raise ValueError(f"checkpoint's step of parameter {index} is {step!r}, not a count of steps")


def all_finite(tensors) -> bool:
    """Whether every element of ``tensors`` is finite, read once at the end (on a GPU a read waits
    for the device). Tested element by element: a norm in a float16 tensor's own dtype is inf beyond
    65504."""
    if not tensors:
        return True
    flags = [torch.isfinite(t).all() for t in tensors]
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())


def _with_group_copies(entries):
    """``entries`` with each param group replaced by a copy of its settings as they are now (tensors
    cloned: a scheduler updates a tensor lr in place)."""
    copies = {}
    for group, _ in entries:
        if id(group) not in copies:
            copies[id(group)] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"
            }
    return [(copies[id(group)], p) for group, p in entries]


class DecoupledMomentumOptimizer(torch.optim.Optimizer):
    """Base class: subclasses choose the momentum input scale and the final update."""

    # A step that nobody contributed to is skipped on every worker alike (False: apply it anyway).
    _skip_empty_steps = True
    # GradScaler hands us grad_scale/found_inf instead of skipping step() on one worker only:
    # a skipped step would leave the other workers waiting in the collective.
    _step_supports_amp_scaling = True
    # group settings that checkpoints of an earlier version may lack (the subclass fills them in)
    _optional_group_keys: tuple[str, ...] = ()

    def __init__(self, params, defaults, comm=None, process_group=None, overlap=False):
        super().__init__(params, defaults)
        self.comm = resolve_backend(comm, process_group)
        self.overlap = bool(overlap)
        self.last_step_timing = {"codec_s": 0.0, "comm_s": 0.0}
        self._transform = DCTTransform()
        self._layouts: dict[tuple, PayloadLayout] = {}
        self._stacks = MomentumStacks(self._transform)
        self._pending = None
        self._decay_factors: dict[tuple, tuple[float, torch.Tensor]] = {}  # see _weight_decay

    def __getstate__(self):
        """Refused, naming the supported way. torch's optimizers copy and pickle only defaults,
        state and param_groups; a copy of this one made that way would lack its backend, transform
        and momentum buffers and fail at its first step."""
        raise TypeError(
            f"{type(self).__name__} cannot be deep-copied or pickled whole (it holds a communication "
            "backend and per-step buffers): save optimizer.state_dict() and load it into a new "
            "optimizer with load_state_dict()"
        )

    def add_param_group(self, param_group) -> None:
        """As torch's, then the group's own settings are validated like the constructor's, so a bad
        per-group value fails here rather than silently doing something else at the first step."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise

    def _check_group(self, group) -> None:
        check_hyperparameters(
            group["lr"], group["weight_decay"], group["compression_decay"], group["compression_topk"],
            group["compression_chunk"], group["compression_bits"],
        )

    # -- hooks -----------------------------------------------------------------------------------
    def _momentum_scale(self, group) -> float:
        raise NotImplementedError

    def _input_unscale(self) -> float:
        """What ``_inputs`` are multiplied by to take out GradScaler's loss scale (``grad_scale``, set
        by GradScaler for an optimizer with ``_step_supports_amp_scaling``; 1.0 when there is none)."""
        grad_scale = getattr(self, "grad_scale", None)
        return 1.0 if grad_scale is None else 1.0 / float(grad_scale)

    def _update(self, group, p, direction: torch.Tensor, state) -> None:
        """Apply the aggregated direction to ``p`` (weight decay included).

        ``direction`` comes in the transform's blocked layout (see ``DCTTransform.decode_many``);
        ``p`` and its state tensors line up with it through ``self._view(t, direction)``."""
        raise NotImplementedError

    @staticmethod
    def _view(t: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """A parameter (or a parameter-shaped state tensor) viewed in ``direction``'s shape, no copy."""
        return t.view(direction.shape)

    def _weight_decay(self, group, p) -> None:
        """Decoupled weight decay, p *= 1 - lr * wd (skipped when wd = 0: no pass over p).

        On the CPU, for float32 and float64, by a 0-d tensor of p's dtype made once per value (the
        same product: torch computes ``mul_`` by a number in p's dtype too), ~1.7 us a tensor faster
        than a number that torch wraps on every call. Other dtypes multiply by the number in float;
        on a GPU a number travels with the kernel, while a new 0-d tensor (the lr of a schedule
        changes every step) would be a copy that waits for the device."""
        if group["weight_decay"] == 0:
            return
        factor = 1 - group["lr"] * group["weight_decay"]
        if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.float64):
            p.mul_(factor)
            return
        if isinstance(factor, torch.Tensor):  # a tensor lr (on the CPU here): its value, once
            factor = factor.item()
        key = (id(group), p.dtype)  # one per group: groups' factors differ; the value is checked
        cached = self._decay_factors.get(key)
        if cached is None or cached[0] != factor:
            if len(self._decay_factors) > 256:  # overlap mode passes a copy of each group per step
                self._decay_factors.clear()
            with kept_tensors():
                tensor = torch.tensor(factor, dtype=p.dtype)
            cached = self._decay_factors[key] = (factor, tensor)
        p.mul_(cached[1])

    @staticmethod
    def _sign_step(group, p, direction) -> None:
        """DeMo's update: p -= lr * sign(direction). ``direction`` is this step's own scratch tensor,
        so its sign is taken in place."""
        p.add_(_as_dtype(direction.sign_(), p.dtype), alpha=-group["lr"])

    def _communicates_this_step(self, entries) -> bool:
        """False for a step that stays local (the local-step mode's inner steps)."""
        return True

    # -- layout ----------------------------------------------------------------------------------
    def _entries(self):
        """(group, parameter) of every parameter that trains; one with no elements has nothing to
        send or update (torch's AdamW accepts such parameters too)."""
        return [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad and p.numel() > 0]

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
            with kept_tensors():
                state["step"] = torch.tensor(0.0)
                state["delta"] = torch.zeros(p.shape, dtype=self._work_dtype(p), device=p.device)
        return state

    def _inputs(self, entries) -> list[torch.Tensor | None]:
        """What each parameter feeds into its momentum this step: its gradient (None: no gradient)."""
        return [p.grad for _, p in entries]

    def _scaler_overflowed(self) -> bool:
        """Whether GradScaler found inf/NaN in this step's gradients (``found_inf``, which it sets for
        an optimizer with ``_step_supports_amp_scaling``, as it sets ``grad_scale``)."""
        found_inf = getattr(self, "found_inf", None)
        return found_inf is not None and float(found_inf) > 0

    def _scaler_found_inf(self) -> bool:
        """``_scaler_overflowed``, with the warning that this worker contributes nothing this step."""
        if self._scaler_overflowed():
            warnings.warn("distro-opt: GradScaler found inf/NaN gradients; this worker contributes nothing this step")
            return True
        return False

    def _compress(self, entries, layout, inputs):
        """Momentum update, top-k, quantization and error feedback, without touching the state.

        Returns (None, None) when an input is not finite, or the momentum overflows the values'
        codec. A NaN or inf anywhere in a chunk spreads to all of that chunk's coefficients, and
        top-k ranks NaN and inf first, so checking the values to send finds it without another pass
        over the gradients. Those are checked as the receivers will decode them: a finite value
        beyond bf16's (or float32's) range is sent as inf, which every receiver would refuse."""
        unscale = self._input_unscale()
        parts, news = [], [None] * len(entries)
        sents = []  # what each segment sends, checked at the end (``all_finite``)
        # every buffer a state tensor views, the frozen parameters' included (a new state's zeros are not one)
        states = [st for st in self.state.values() if isinstance(st, dict) and "delta" in st]
        in_use = {st["delta"].untyped_storage().data_ptr() for st in states}
        for j, seg in enumerate(layout.segments):
            deltas = [self._state(entries[m][1], layout.specs[m])["delta"] for m in seg.members]
            stack = self._stacks.spare(j, seg, deltas, in_use)
            old = self._stacks.committed(j, seg, deltas, stack)
            n, last = seg.chunk_numel, seg.chunk[-1]
            peaks = self._stacks.peaks(layout, j, seg, stack)
            filled = peaks is not None  # every run's peaks taken during the transform
            for run, (a, b) in transform_runs(entries, layout, seg):  # new = decay * Delta + scale * DCT(g)
                group = entries[run[0]][0]
                xs = [self._input(entries[m][1], inputs[m], stack.dtype) for m in run]
                filled &= self._transform.accumulate(
                    xs, seg.chunk, old[a * n : b * n], stack[a * n : b * n],
                    decay=group["compression_decay"], scale=self._momentum_scale(group) * unscale,
                    peaks=None if peaks is None else peaks[a * n // last : b * n // last],
                )
            idx, kept, feedback = self._stacks.select(layout, j, seg, stack, peaks if filled else None)
            vbytes, sent = value_codec(seg.bits).encode(kept)
            sents.append(sent)
            feedback(sent)  # error feedback: keep what was not sent
            parts.append((idx, vbytes))
            with kept_tensors():  # the new state: views of the kept buffer, copies where dtypes mix
                for m, d, (start, end) in zip(seg.members, deltas, seg.rows):
                    news[m] = _as_dtype(stack[start * n : end * n].view(d.shape), d.dtype)
        if not all_finite(sents):
            warnings.warn(
                "distro-opt: non-finite local gradient (or momentum beyond the range of compression_bits' "
                "values); this worker contributes nothing this step"
            )
            return None, None
        return parts, news

    @staticmethod
    def _input(p, x, dtype) -> torch.Tensor:
        if x is None:
            return torch.zeros(p.shape, dtype=dtype, device=p.device)
        return _as_dtype(x, dtype)

    def _decode_all(self, entries, layout, bufs):
        decoded = []
        drops = getattr(self.comm, "drops_invalid_payloads", False)
        for i, buf in enumerate(bufs):
            try:
                payload = layout.decode(buf)
                if payload is not None:
                    payload = self._in_work_dtypes(entries, layout, payload)
            except PayloadError as exc:
                if not drops:
                    raise PayloadError(f"payload of worker {i} rejected: {exc}") from None
                warnings.warn(f"distro-opt: dropped invalid payload {i}: {exc}")
                self.comm.report_invalid(i)
                continue
            if payload is not None:
                decoded.append(payload)
        return decoded

    def _in_work_dtypes(self, entries, layout, payload):
        """Each segment's values in the dtype they are applied in (its first member's momentum),
        refused where that dtype cannot hold them: finite float64 values (``compression_bits=64``)
        beyond float32's range would be applied as inf."""
        out = []
        for j, (seg, (idx, values)) in enumerate(zip(layout.segments, payload)):
            dtype = self._work_dtype(entries[seg.members[0]][1])
            narrower = torch.finfo(dtype).max < torch.finfo(values.dtype).max
            values = _as_dtype(values, dtype)
            if narrower and not torch.isfinite(values).all():
                raise PayloadError(f"payload values beyond the range of {dtype} in segment {j}")
            out.append((idx, values))
        return out

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
            # applied updates: the same count on every worker (adding a 0-d tensor per step tensor is
            # ~4x faster here than adding the number 1.0, which torch wraps once per tensor)
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, [torch.ones((), dtype=steps[0].dtype)] * len(steps))
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
        decoded = self._decode_all(entries, layout, bufs)
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
        with torch.inference_mode():  # no autograd bookkeeping per operation (see kept.py)
            self._step()
        return loss

    def _step(self) -> None:
        t0 = time.perf_counter()
        entries = self._entries()
        if not self._communicates_this_step(entries):
            self.last_step_timing = {"codec_s": 0.0, "comm_s": 0.0}
            return
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
            previous, self._pending = self._pending, None

            def commit_and_send():  # once step t-1's payloads are valid: a rejected step changes nothing
                commit()
                # the update lands at the next step, but with this step's hyperparameters, as when
                # blocking: a scheduler stepped in between, or a flush by one rank alone (state_dict),
                # must not change what any worker applies
                self._pending = (self.comm.start_all_gather(buf), _with_group_copies(entries), layout)

            if previous is None:
                commit_and_send()
                comm_s, apply_s = 0.0, 0.0
            else:
                comm_s, apply_s = self._finish(previous, before_apply=commit_and_send)
        else:
            pending = (self.comm.start_all_gather(buf), entries, layout)
            comm_s, apply_s = self._finish(pending, before_apply=commit)
        self.last_step_timing = {"codec_s": codec_s + apply_s, "comm_s": comm_s}

    @torch.no_grad()
    def flush(self) -> None:
        """Overlap mode: wait for the last collective and apply its update (a no-op otherwise)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with torch.inference_mode():
                self._finish(pending)

    def state_dict(self):
        """As torch's, after ``flush()`` so that no started update is lost from the checkpoint.

        In overlap mode this applies the pending update now rather than at the next step, so a run
        that saves at step t follows a (slightly) different path than one that does not; resuming
        from the checkpoint reproduces the saving run exactly.

        ``state[p]["delta"]`` (the error-feedback momentum, DCT domain) has ``p``'s shape: element
        [i, j] of a 2-D one is coefficient (i mod c_1, j mod c_2) of chunk (i // c_1, j // c_2).
        The ``delta_layout`` entry says so; checkpoints without it (distro-opt before it) kept one
        (chunks, coefficients) row per chunk and are converted on loading. ``optimizer`` names the
        class: DeMo's momentum is scaled by the lr, DisTrOAdamW's is not, so one cannot resume the
        other."""
        self.flush()
        sd = super().state_dict()
        sd["delta_layout"] = DELTA_LAYOUT
        sd["optimizer"] = type(self).__name__
        return sd

    def load_state_dict(self, state_dict):
        """As torch's, but buffers keep their saved dtype: torch would cast them to the parameter's
        dtype, and a bf16 model's float32 error-feedback buffer would lose its low bits.

        Everything is checked before anything changes (``_check_checkpoint``): the optimizer class,
        every group's settings (a checkpoint of torch's AdamW lacks the compression settings), and
        each parameter's state (step and delta together, a finite floating-point delta, every
        parameter-shaped tensor of the parameter's shape)."""
        state_dict = dict(state_dict)
        saved_class = state_dict.pop("optimizer", type(self).__name__)
        if saved_class != type(self).__name__:
            raise ValueError(
                f"checkpoint is of a {saved_class}, not a {type(self).__name__}: it cannot be resumed here"
            )
        delta_layout = state_dict.pop("delta_layout", None)
        if delta_layout not in (None, DELTA_LAYOUT, "chunk rows"):
            raise ValueError(f"checkpoint has an unknown delta_layout {delta_layout!r} (expected {DELTA_LAYOUT!r})")
        params = [p for g in self.param_groups for p in g["params"]]
        row_deltas = self._check_checkpoint(state_dict, params, delta_layout)
        super().load_state_dict(state_dict)
        self._pending = None  # only once the load succeeded: a refused one keeps the update in flight
        self._stacks.reset()  # the loaded momentum may be views of these; start from fresh buffers
        for index, saved in state_dict["state"].items():
            if isinstance(index, int) and index < len(params):
                p = params[index]
                state = self.state[p]
                for key, value in saved.items():
                    if torch.is_tensor(value) and key != "step" and state[key].dtype != value.dtype:
                        state[key] = value.to(device=p.device, copy=True)
                step = state.get("step")
                counted = torch.is_tensor(step) and step.dim() == 0 and step.is_floating_point()
                if step is not None and not counted:
                    state["step"] = torch.tensor(float(step))  # saved as a number, or an integer tensor
                if index in row_deltas:
                    shape = tuple(p.shape) or (1,)
                    rows = self._transform.unchunk(state["delta"], shape, row_deltas[index])
                    state["delta"] = rows.view(p.shape)

    def _check_checkpoint(self, state_dict, params, delta_layout) -> dict[int, tuple[int, ...]]:
        """Refuse a checkpoint this optimizer cannot resume, naming what is wrong; return the chunk
        shape of each delta saved as (chunks, coefficients) rows (the layout before ``DELTA_LAYOUT``),
        taken with the checkpoint's own compression_chunk. Without a ``delta_layout`` entry each delta
        is told by its shape; where both layouts have its shape (an (n, 4096) matrix of 64x64 chunks)
        it is read as rows, as it was before that entry existed."""
        groups = state_dict.get("param_groups", [])
        required = set.intersection(*(set(g) for g in self.param_groups))
        required -= {"params", *self._optional_group_keys}
        chunk_target = {}
        for i, group in enumerate(groups):
            missing = sorted(required - set(group))
            if missing:
                raise ValueError(
                    f"checkpoint's param group {i} lacks {', '.join(missing)}: not a checkpoint of a "
                    f"{type(self).__name__}"
                )
            try:
                self._check_group(group)
            except ValueError as exc:
                raise ValueError(f"checkpoint's param group {i}: {exc}") from None
            chunk_target.update({index: group["compression_chunk"] for index in group.get("params", [])})
        row_deltas = {}
        for index, saved in state_dict.get("state", {}).items():
            if not (isinstance(index, int) and index < len(params)):
                continue
            p = params[index]
            if ("delta" in saved) != ("step" in saved):
                raise ValueError(
                    f"checkpoint's state of parameter {index} has one of delta and step without the other"
                )
            _check_step(index, saved.get("step"))
            for key in PARAM_SHAPED_STATE:
                value = saved.get(key)
                if value is None:
                    continue
                if not (torch.is_tensor(value) and value.is_floating_point()):
                    raise ValueError(
                        f"checkpoint's {key} of parameter {index} is not a floating-point tensor"
                    )
                if key != "delta" and tuple(value.shape) != tuple(p.shape):  # delta's layouts: below
                    raise ValueError(
                        f"checkpoint's {key} of parameter {index} is not a tensor of its shape "
                        f"{tuple(p.shape)}"
                    )
                if not bool(torch.isfinite(value).all()):
                    raise ValueError(f"checkpoint's {key} of parameter {index} holds non-finite values")
                if key.endswith("exp_avg_sq") and bool((value < 0).any()):
                    raise ValueError(f"checkpoint's {key} of parameter {index} holds negative values")
            delta = saved.get("delta")
            if delta is None:
                continue
            target = chunk_target.get(index, self.defaults["compression_chunk"])
            chunk = self._transform.chunk_shape(tuple(p.shape), target)
            rows = (p.numel() // math.prod(chunk), math.prod(chunk))
            shape = tuple(delta.shape)
            as_rows = shape == rows if delta_layout is None else delta_layout == "chunk rows"
            expected = rows if as_rows else tuple(p.shape)
            if shape != expected:
                raise ValueError(
                    f"checkpoint's delta for parameter {index} has shape {shape}, expected {expected} "
                    f"(delta_layout {delta_layout or 'tensor'!r})"
                )
            same_layout = rows == tuple(p.shape) and self._transform.own_layout_is_chunk_major(p.shape, chunk)
            if as_rows and not same_layout:
                row_deltas[index] = chunk
        return row_deltas
