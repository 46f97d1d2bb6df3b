"""Checking a checkpoint before it is loaded, and reading the layouts it may come in.

``state[p]["delta"]`` (the error-feedback momentum, DCT domain) has ``p``'s shape: element [i, j] of
a 2-D one is coefficient (i mod c_1, j mod c_2) of chunk (i // c_1, j // c_2). A state dict says so
in its ``delta_layout`` entry (``DELTA_LAYOUT``); the "chunk rows" layout, one (chunks, coefficients)
row per chunk, is read too and converted on loading.
"""
from __future__ import annotations

import math

import torch

from .dct import chunk_shape, own_layout_is_chunk_major, unchunk
from .shards import is_sharded, local

DELTA_LAYOUT = "tensor"
ROWS_LAYOUT = "chunk rows"
# State tensors of a parameter's shape (DisTrOAdamW's Adam update and local-step mode add some).
PARAM_SHAPED_STATE = (
    "delta", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "anchor", "outer_momentum_buffer", "input_exp_avg_sq",
)


def by_position(state_dict: dict) -> dict:
    """``state_dict`` with its parameters named by position (0, 1, ... over the groups in order), as
    ``Optimizer.state_dict`` names them; torch.distributed.checkpoint names them by their module
    path instead (a parameter's FQN), which ``Optimizer.load_state_dict`` matches by order too."""
    groups = state_dict.get("param_groups", [])
    saved = [pid for g in groups for pid in g.get("params", [])]
    if all(isinstance(pid, int) for pid in saved) and saved == list(range(len(saved))):
        return state_dict
    position = {pid: n for n, pid in enumerate(saved)}
    out = dict(state_dict)
    out["param_groups"] = [{**g, "params": [position[pid] for pid in g.get("params", [])]} for g in groups]
    out["state"] = {position.get(k, k): v for k, v in state_dict.get("state", {}).items()}
    return out


def check_step(index, step) -> None:
    """A checkpoint's step count: a number or a one-element real tensor, finite and >= 0."""
    if step is None:
        return
    if torch.is_tensor(step):
        ok = step.numel() == 1 and not step.is_complex() and step.dtype != torch.bool
    else:
        ok = isinstance(step, (int, float)) and not isinstance(step, bool)
    if not (ok and math.isfinite(float(step)) and float(step) >= 0):
        raise ValueError(f"checkpoint's step of parameter {index} is {step!r}, not a count of steps")


def check_groups(state_dict, param_groups, optional_keys, check_group, name: str) -> dict[int, int]:
    """Every saved group has this optimizer's settings and they pass ``check_group``; returns each
    saved parameter index's compression_chunk."""
    required = set.intersection(*(set(g) for g in param_groups)) - {"params", *optional_keys}
    chunk_target = {}
    for i, group in enumerate(state_dict.get("param_groups", [])):
        missing = sorted(required - set(group))
        if missing:
            raise ValueError(f"checkpoint's param group {i} lacks {', '.join(missing)}: not a checkpoint of a {name}")
        try:
            check_group(group)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"checkpoint's param group {i}: {exc}") from None
        chunk_target.update({index: group["compression_chunk"] for index in group.get("params", [])})
    return chunk_target


def check_param_states(state_dict, params, chunk_target, default_chunk, delta_layout) -> dict[int, tuple]:
    """Refuse a parameter state this optimizer cannot resume (step and delta together, a finite
    floating-point delta, every parameter-shaped tensor of the parameter's shape, no negative second
    moment); return the chunk shape of each delta saved as rows that must be converted.

    Without a ``delta_layout`` entry each delta is told by its shape; where both layouts have its
    shape (an (n, 4096) matrix of 64x64 chunks) it is read as rows."""
    row_deltas = {}
    for index, saved in state_dict.get("state", {}).items():
        if not (isinstance(index, int) and index < len(params)):
            continue
        p = params[index]
        if ("delta" in saved) != ("step" in saved):
            raise ValueError(f"checkpoint's state of parameter {index} has one of delta and step without the other")
        check_step(index, saved.get("step"))
        for key in PARAM_SHAPED_STATE:
            _check_tensor(index, key, saved.get(key), p)
        delta = saved.get("delta")
        if delta is None:
            continue
        chunk = chunk_shape(tuple(p.shape), chunk_target.get(index, default_chunk))
        rows = (p.numel() // math.prod(chunk), math.prod(chunk))
        shape = tuple(delta.shape)
        if is_sharded(p):  # rows are a layout of plain tensors' checkpoints only
            if delta_layout == ROWS_LAYOUT:
                raise ValueError(f"checkpoint's delta for sharded parameter {index} is in the {ROWS_LAYOUT!r} layout")
            as_rows = False
        else:
            as_rows = shape == rows if delta_layout is None else delta_layout == ROWS_LAYOUT
        expected = rows if as_rows else tuple(p.shape)
        if shape != expected:
            raise ValueError(
                f"checkpoint's delta for parameter {index} has shape {shape}, expected {expected} "
                f"(delta_layout {delta_layout or DELTA_LAYOUT!r})"
            )
        same_layout = rows == tuple(p.shape) and own_layout_is_chunk_major(p.shape, chunk)
        if as_rows and not same_layout:
            row_deltas[index] = chunk
    return row_deltas


def check_no_state_lost(state_dict, param_groups, opt_state) -> None:
    """Refuse a checkpoint that has no state for a parameter that has state in this optimizer:
    torch's ``load_state_dict`` would drop that state (its error feedback, its Adam moments) and
    the parameter would restart from nothing, silently. A fresh optimizer has no state to lose."""
    saved = state_dict.get("state", {})
    index = 0
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            if opt_state.get(p) and not saved.get(index):
                raise ValueError(
                    f"checkpoint has no state for parameter {index} (param group {g}, shape "
                    f"{tuple(p.shape)}), which has state in this optimizer ({', '.join(sorted(opt_state[p]))}): "
                    "loading it would reset that parameter's state. Load a checkpoint saved by an "
                    "optimizer that stepped every parameter, or load it into a new optimizer"
                )
            index += 1


def _check_tensor(index, key, value, p) -> None:
    if value is None:
        return
    if not (torch.is_tensor(value) and value.is_floating_point()):
        raise ValueError(f"checkpoint's {key} of parameter {index} is not a floating-point tensor")
    if key != "delta" and tuple(value.shape) != tuple(p.shape):  # delta's layouts: check_param_states
        raise ValueError(f"checkpoint's {key} of parameter {index} is not a tensor of its shape {tuple(p.shape)}")
    value = local(value)  # a shard's values: this rank checks its own, with no collective
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"checkpoint's {key} of parameter {index} holds non-finite values")
    if key.endswith("exp_avg_sq") and bool((value < 0).any()):
        raise ValueError(f"checkpoint's {key} of parameter {index} holds negative values")


def restore_loaded(opt_state, state_dict, params, row_deltas) -> None:
    """After torch's ``load_state_dict``: buffers get their saved dtype back (torch casts them to the
    parameter's, and a bf16 model's float32 momentum would lose its low bits), a step saved as a
    number or integer tensor becomes torch's float count, and row deltas the parameter's layout."""
    for index, saved in state_dict["state"].items():
        if not (isinstance(index, int) and index < len(params)):
            continue
        p = params[index]
        state = opt_state[p]
        for key, value in saved.items():
            if torch.is_tensor(value) and key != "step" and state[key].dtype != value.dtype:
                state[key] = value.to(device=p.device, copy=True)
        step = state.get("step")
        counted = torch.is_tensor(step) and step.dim() == 0 and step.is_floating_point()
        if step is not None and not counted:
            state["step"] = torch.tensor(float(step))
        if index in row_deltas:
            state["delta"] = unchunk(state["delta"], tuple(p.shape) or (1,), row_deltas[index]).view(p.shape)
