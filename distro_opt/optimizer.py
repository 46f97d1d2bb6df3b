"""The torch.optim side of DeMo and DisTrOAdamW: groups, state, step(), overlap, checkpoints.

``step()`` runs the pipeline of ``step.py`` with this optimizer's parts: its communication backend
(``distro_opt.comm``), its transform, its momentum buffers, the step plan of each layout
(``plan.py``, cached), its input source (``local_steps.py``: the gradients, or pseudo-gradients
every H steps) and each group's update rule (``updates.py``). ``_step`` reads top to bottom.
A subclass says two things: each group's momentum input scale and its update rule.

``step()`` and ``flush()`` run under ``torch.inference_mode()``, so the step's many small tensor
operations skip autograd's bookkeeping. Tensors made there are inference tensors, which cannot be
updated in place outside it; so what the optimizer keeps between steps (its state, reused buffers,
cached tables) is made under ``torch.inference_mode(False)`` and stays an ordinary tensor, which
users may inspect, modify and save as with any torch optimizer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from distro_opt.comm import Backend, CommStats, PendingGather

from . import checkpoint, guards, shards
from .settings import check_hyperparameters, check_params
from .local_steps import GRADIENTS
from .momentum import MomentumStacks
from .plan import StepPlan, plan_key, plan_step
from .precondition import MOMENT, commit as commit_moments, precondition
from .step import aggregator, apply_update, check_inputs, compress, momentum_state, unpack_payloads
from .transform import DCTTransform
from .updates import WeightDecay
from .wire import PayloadLayout, param_spec


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


# State tensors that differ from worker to worker (the error feedback; the preconditioner's second
# moment of the worker's own gradients): saved once per replica where parameters are sharded
PER_WORKER = ("delta", MOMENT)


@dataclass
class _InFlight:
    """A started gather and what its update applies to: the step's entries (in overlap mode with
    copies of their groups' settings as they were) and its payload layout."""

    handle: PendingGather
    entries: list
    layout: PayloadLayout


class DecoupledMomentumOptimizer(torch.optim.Optimizer):
    """Base class of DeMo and DisTrOAdamW; subclasses give ``_momentum_scale`` and ``_update_rule``."""

    # GradScaler hands us grad_scale/found_inf instead of skipping step() on one worker only:
    # a skipped step would leave the other workers waiting in the collective.
    _step_supports_amp_scaling = True
    # group settings that older checkpoints may lack (the subclass fills them in)
    _optional_group_keys: tuple[str, ...] = ()
    # what feeds the momentum (``local_steps.py``); a class default because torch's constructor
    # calls add_param_group, which reads it, before __init__ could set it
    _source = GRADIENTS
    # what the error feedback subtracts (``settings.FEEDBACKS``); DisTrOAdamW lets the user choose
    error_feedback = "sent"

    def __init__(self, params, defaults, comm=None, process_group=None, overlap=False):
        super().__init__(params, defaults)
        self._layouts: dict[tuple, PayloadLayout] = {}
        self._start = guards.TrainingStart(type(self).__name__, comm, process_group)
        self.overlap = bool(overlap)
        # seconds of the last step: in the backend (starting and waiting for the gather) and the rest
        self.last_step_timing = {"codec_s": 0.0, "comm_s": 0.0}
        self._transform = DCTTransform()
        self._stacks = MomentumStacks()
        self._plans: dict[tuple, StepPlan] = {}
        self._weight_decay = WeightDecay()
        self._pending: _InFlight | None = None  # overlap mode: the gather started last step

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
            check_params(self.param_groups[-1]["params"])
            self._check_group(self.param_groups[-1])
        except (ValueError, TypeError):
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise
        self._source.add_param_group(self.param_groups[-1])

    def _check_group(self, group) -> None:
        check_hyperparameters(
            group["lr"], group["weight_decay"], group["compression_decay"], group["compression_topk"],
            group["compression_chunk"], group["compression_bits"],
        )

    def _momentum_scale(self, group) -> float:
        """The input scale s of ``Delta = beta * Delta + s * DCT(g)`` for this group."""
        raise NotImplementedError

    def _update_rule(self, group):
        """The rule (``updates.py``) that applies this group's aggregated direction."""
        raise NotImplementedError

    # -- communication --------------------------------------------------------------------------
    @property
    def comm(self) -> Backend:
        """The communication backend. ``comm=None`` is resolved at the first step or the first read
        of this attribute: torch.distributed's default group if it is initialized by then, else a
        single worker (``guards.TrainingStart``)."""
        return self._start.backend(lambda: self.payload_layout)

    @property
    def replica_check_stats(self) -> CommStats:
        """The bytes and collectives of the replica checks (``guards.py``), also in ``comm.stats``."""
        return self._start.replica_check_stats

    # -- layout ----------------------------------------------------------------------------------
    def _entries(self):
        """(group, parameter) of every parameter that trains; one with no elements has nothing to
        send or update (torch's AdamW accepts such parameters too)."""
        return [
            (g, p) for g in self.param_groups for p in g["params"] if p.requires_grad and shards.local(p).numel() > 0
        ]

    def _layout(self, entries) -> PayloadLayout:
        """The payload layout of ``entries``, by each one's local shape (a DTensor's shard)."""
        key = tuple(
            (tuple(shards.local(p).shape), g["compression_topk"], g["compression_chunk"], g["compression_bits"])
            for g, p in entries
        )
        if key not in self._layouts:
            self._layouts[key] = PayloadLayout([param_spec(*k) for k in key])
        return self._layouts[key]

    @property
    def payload_layout(self) -> PayloadLayout:
        """The wire layout of this worker's payload; ``payload_layout.unpack(buf)`` validates one."""
        return self._layout(self._entries())

    @property
    def payload_nbytes(self) -> int:
        """Bytes this worker sends per collective (the buffer's size), known before any step."""
        return self.payload_layout.nbytes

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.inference_mode():
            self._step()
        return loss

    def _step(self) -> None:
        """One step, top to bottom: the replica checks when due; this worker's payload (stages 1-5
        of ``step.py``); then, blocking, the gather, its validation, the commit of the new momentum
        and the update; or, in overlap mode, the previous step's gather received, this step's
        momentum committed and its gather started, and the previous step's update applied."""
        t0 = time.perf_counter()
        entries = self._entries()
        if self._start.checks_due:
            self._check_replicas(entries)
        if not self._source.communicates(self, entries):  # a local step: nothing to send
            self.last_step_timing = {"codec_s": 0.0, "comm_s": 0.0}
            return
        layout = self._layout(entries)
        parts, news = self._compress(entries, layout) if self._source.contributes(self) else (None, None)
        buf = layout.pack(parts)
        if self.overlap:  # step t's collective travels while step t+1 computes; its update lands then
            previous, self._pending = self._pending, None
            unpacked, wait_s = self._receive(previous) if previous is not None else (None, 0.0)
            self._commit(entries, news)
            # the update lands at the next step, but with this step's hyperparameters, as when
            # blocking: a scheduler stepped in between, or a flush by one rank alone (state_dict),
            # must not change what any worker applies
            self._pending, start_s = self._start_gather(buf, _with_group_copies(entries), layout)
            if previous is not None:
                self._apply(previous, unpacked)
        else:
            flight, start_s = self._start_gather(buf, entries, layout)
            unpacked, wait_s = self._receive(flight)
            self._commit(entries, news)  # only now: a rejected step changes nothing
            self._apply(flight, unpacked)
        comm_s = start_s + wait_s
        self.last_step_timing = {"codec_s": time.perf_counter() - t0 - comm_s, "comm_s": comm_s}

    def _check_replicas(self, entries) -> None:
        """The start checks (``guards.TrainingStart``); the replicas are compared by their anchors in
        the local-step mode."""
        replicas = [self.state.get(p, {}).get("anchor", p) for _, p in entries]
        settings = guards.settings_of(
            self.param_groups, optimizer=type(self).__name__, error_feedback=self.error_feedback,
            overlap=self.overlap, sync_every=getattr(self, "sync_every", 1),
        )
        self._start.check(self.comm, [p for _, p in entries], replicas, settings)

    def _compress(self, entries, layout: PayloadLayout):
        """This worker's payload parts and what its state becomes (``step.compress``: the new momenta;
        ``precondition.py``: the new moments of the inputs); the state is untouched."""
        self._stacks.begin_step([
            shards.local(st["delta"]) for st in self.state.values() if isinstance(st, dict) and "delta" in st
        ])
        inputs = [shards.local(x) for x in self._source.inputs(self, entries)]
        check_inputs(entries, inputs)
        work, states = self._local_work(entries)
        inputs, moments = precondition(work, inputs, states.dicts)
        unscale = self._source.unscale(self)
        scales = {id(g): self._momentum_scale(g) * unscale for g, _ in entries}
        plan = self._plan(layout, entries, [st["delta"] for st in states.dicts])
        parts, news = compress(
            plan, work, inputs, states.dicts, self._stacks, self._transform, scales, feedback=self.error_feedback
        )
        states.write_back()
        return (None, None) if news is None else (parts, (news, moments))

    def _plan(self, layout: PayloadLayout, entries, deltas) -> StepPlan:
        """The step plan (``plan.py``) of ``layout`` for ``entries`` with momenta ``deltas``, cached."""
        position = {id(g): i for i, g in enumerate(self.param_groups)}
        group_of = [position[id(g)] for g, _ in entries]
        key = plan_key(layout, group_of, deltas)
        if key not in self._plans:
            self._plans[key] = plan_step(layout, group_of, deltas)
        return self._plans[key]

    def _commit(self, entries, news) -> None:
        """The step's new momenta and input moments become the state (nothing where this worker
        contributed nothing)."""
        if news is None:
            return
        momenta, moments = news
        for (_, p), new in zip(entries, momenta):
            self.state[p]["delta"] = shards.like_param(new, p)
        commit_moments(entries, moments, self.state)

    def _start_gather(self, buf, entries, layout) -> tuple[_InFlight, float]:
        """This step's gather started; returns it with the seconds the backend took to start it."""
        t0 = time.perf_counter()
        flight = _InFlight(self.comm.start_all_gather(buf), entries, layout)
        return flight, time.perf_counter() - t0

    def _receive(self, flight: _InFlight) -> tuple[list, float]:
        """Wait for ``flight``'s gather and validate every payload (``step.unpack_payloads``), which
        raises before anything is written where one is invalid (unless the backend drops invalid
        ones). Returns the unpacked payloads and the seconds spent waiting."""
        t0 = time.perf_counter()
        bufs = flight.handle.wait()
        wait_s = time.perf_counter() - t0
        return unpack_payloads(flight.entries, flight.layout, bufs, self.comm), wait_s

    def _apply(self, flight: _InFlight, unpacked) -> None:
        """Stages 8-10 of ``flight``'s payloads (``step.apply_update``); a step nobody contributed to
        is skipped alike on every worker where the input source says so."""
        if not unpacked and self._source.skips_empty_steps:
            return
        work, states = self._local_work(flight.entries)
        apply_update(
            work, flight.layout, unpacked, states.dicts, self._transform, self._update_rule,
            aggregator(self.comm.untrusted_fraction),
        )
        states.write_back()
        self._source.after_update(self, flight.entries)

    def _local_work(self, entries):
        """The step's view of ``entries``: (group, local tensor) pairs, and their states with the
        momentum created where missing (``shards.LocalStates``; plain parameters are their own)."""
        states = shards.LocalStates(self.state, [p for _, p in entries])
        work = [(g, shards.local(p)) for g, p in entries] if states.any_sharded else entries
        for state, (_, p) in zip(states.dicts, work):
            momentum_state(state, p)
        return work, states

    @torch.no_grad()
    def flush(self) -> None:
        """Overlap mode: wait for the last collective and apply its update (a no-op otherwise)."""
        if self._pending is not None:
            flight, self._pending = self._pending, None
            with torch.inference_mode():
                self._apply(flight, self._receive(flight)[0])

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self):
        """As torch's, after ``flush()`` so that no started update is lost from the checkpoint.

        In overlap mode this applies the pending update now rather than at the next step, so a run
        that saves at step t follows a (slightly) different path than one that does not; resuming
        from the checkpoint reproduces the saving run exactly. ``delta_layout`` says how the
        momentum is laid out (``checkpoint.py``); ``optimizer`` names the class: DeMo's momentum is
        scaled by the lr, DisTrOAdamW's is not, so one cannot resume the other. The local-step mode
        adds its count to the groups and its inner optimizer's state to each parameter's
        (``local_steps.LocalSteps.save``)."""
        self.flush()
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        sd["state"] = {i: self._saveable(st, params[i]) if isinstance(st, dict) else st for i, st in sd["state"].items()}
        sd["delta_layout"] = checkpoint.DELTA_LAYOUT
        sd["optimizer"] = type(self).__name__
        self._source.save(self, sd)
        return sd

    @staticmethod
    def _saveable(state: dict, p) -> dict:
        """One parameter's state as saved: each worker's own tensors (``PER_WORKER``) in
        ``shards.per_replica``'s layout where ``p`` is sharded (the DTensor shard of a momentum stack
        copied)."""
        if shards.is_sharded(p):  # per_replica copies the shard: saveable then need not
            state = {**state, **{k: shards.per_replica(state[k], p) for k in PER_WORKER if k in state}}
        return shards.saveable(state)

    def load_state_dict(self, state_dict):
        """As torch's, but buffers keep their saved dtype: torch would cast them to the parameter's,
        and a bf16 model's float32 error-feedback buffer would lose its low bits.

        Everything is checked before anything changes: the optimizer class and mode, every group's
        settings (a checkpoint of torch's AdamW lacks the compression settings), each parameter's
        state (``checkpoint.py``), and that no parameter with state here (its error feedback) is
        missing from the checkpoint: torch would silently reset that parameter's state."""
        state_dict = dict(checkpoint.by_position(state_dict))
        taken = self._source.take_from(state_dict)
        saved_class = state_dict.pop("optimizer", type(self).__name__)
        if saved_class != type(self).__name__:
            raise ValueError(f"checkpoint is of a {saved_class}, not a {type(self).__name__}: it cannot be resumed here")
        delta_layout = state_dict.pop("delta_layout", None)
        if delta_layout not in (None, checkpoint.DELTA_LAYOUT, checkpoint.ROWS_LAYOUT):
            raise ValueError(
                f"checkpoint has an unknown delta_layout {delta_layout!r} (expected {checkpoint.DELTA_LAYOUT!r})"
            )
        params = [p for g in self.param_groups for p in g["params"]]
        state_dict["state"] = {
            i: {**st, **{k: shards.from_per_replica(st[k], params[i]) for k in PER_WORKER if k in st}}
            if isinstance(i, int) and i < len(params) and isinstance(st, dict) else st
            for i, st in state_dict.get("state", {}).items()
        }
        chunk_target = checkpoint.check_groups(
            state_dict, self.param_groups, self._optional_group_keys, self._check_group, type(self).__name__
        )
        row_deltas = checkpoint.check_param_states(
            state_dict, params, chunk_target, self.defaults["compression_chunk"], delta_layout
        )
        checkpoint.check_no_state_lost(state_dict, self.param_groups, self.state)
        super().load_state_dict(state_dict)
        self._pending = None  # only once the load succeeded: a refused one keeps the update in flight
        self._start.replicas_due = True  # a checkpoint loaded on one rank only would split the replicas
        self._stacks.reset()  # the loaded momentum may be views of these; start from fresh buffers
        checkpoint.restore_loaded(self.state, state_dict, params, row_deltas)
        self._source.finish_load(self, taken)
