"""Communication backends for distro-opt, imported as ``distro_opt.comm``.

Every backend implements ``Backend``: it moves opaque uint8 buffers and counts bytes in its
``CommStats``; it never interprets a payload.
"""
if __name__ == "comm":  # pragma: no cover - guards a packaging mistake, see the message
    raise ImportError(
        "distro-opt's comm/ folder was imported as a top-level package 'comm' (the repository root is "
        "on sys.path). That name belongs to Jupyter's 'comm' package; import 'distro_opt.comm' and run "
        "from outside the repository root, or with 'pytest' rather than 'python -m pytest'."
    )

import os

from .base import Backend, CommStats, PendingGather, SingleWorkerBackend, warn_at_caller
from .inprocess import InProcessBackend, InProcessGroupError

__all__ = [
    "Backend",
    "CommStats",
    "PendingGather",
    "SingleWorkerBackend",
    "InProcessBackend",
    "InProcessGroupError",
    "check_comm",
    "resolve_backend",
    "TorchDistributedBackend",
    "HivemindBackend",
    "HivemindBackendError",
]

_LAZY = {  # optional transports: imported on first use, so hivemind stays an optional dependency
    "TorchDistributedBackend": "torch_backend",
    "HivemindBackend": "hivemind_backend",
    "HivemindBackendError": "hivemind_backend",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_comm(comm=None, process_group=None):
    """What a user passed as ``comm=`` (or ``process_group=``), checked: a ``Backend``, a
    torch.distributed ``ProcessGroup``, or ``None`` (the default group, looked up only when the
    optimizer first needs it: see ``resolve_backend``). Anything else raises ``TypeError`` here,
    at construction, rather than at the first step."""
    if comm is not None and process_group is not None:
        raise ValueError("Pass either comm= or process_group=, not both")
    target = comm if comm is not None else process_group
    if target is None or isinstance(target, Backend):
        return target
    import torch.distributed as dist

    if dist.is_available() and isinstance(target, dist.ProcessGroup):
        return target
    raise TypeError(
        f"Invalid comm: {type(target).__name__} (expected None, a distro_opt.comm.Backend "
        "or a torch.distributed ProcessGroup)"
    )


def resolve_backend(comm=None, process_group=None, environ=None) -> Backend:
    """Turn what a user passed as ``comm=`` (or ``process_group=``) into a ``Backend``.

    ``None``: torch.distributed's default group when it is initialized, else a single worker.
    A ``Backend`` is used as it is; a torch.distributed ``ProcessGroup`` is wrapped.

    ``None`` without a group while ``environ`` (default ``os.environ``) says ``WORLD_SIZE`` > 1 (a
    launcher such as torchrun started several ranks) warns: each rank would train alone.
    """
    target = check_comm(comm, process_group)
    if isinstance(target, Backend):
        return target
    import torch.distributed as dist

    from .torch_backend import TorchDistributedBackend

    if target is not None:
        return TorchDistributedBackend(group=target)
    if dist.is_available() and dist.is_initialized():
        return TorchDistributedBackend()
    _warn_if_launched_as_ranks(os.environ if environ is None else environ)
    return SingleWorkerBackend()


def _warn_if_launched_as_ranks(environ) -> None:
    problem = _launch_problem(environ)
    if problem is not None:
        warn_at_caller(f"distro-opt: {problem}")


def _launch_problem(environ) -> str | None:
    """What in a launcher's environment asks for several ranks where this process sees no
    torch.distributed group, as a sentence; None if nothing does.

    torchrun (and accelerate's multi-process launcher) set ``WORLD_SIZE``. accelerate's simple
    launcher, which ``accelerate launch --num_processes N`` picks on CPUs unless ``--multi_gpu`` is
    given, starts one process and sets no ``WORLD_SIZE``, but sets ``MASTER_PORT`` for N > 1 beside
    its ``ACCELERATE_*`` variables: that is the case told apart here.
    """
    alone = "so this rank trains alone as a single worker and exchanges nothing."
    try:
        world_size = int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world_size > 1:
        return (
            f"WORLD_SIZE={world_size} but no torch.distributed process group is initialized, {alone} "
            "Call torch.distributed.init_process_group() before the optimizer's first step (or pass "
            "comm= a backend or ProcessGroup)."
        )
    if "WORLD_SIZE" not in environ and "MASTER_PORT" in environ and any(k.startswith("ACCELERATE_") for k in environ):
        return (
            "accelerate launch was asked for several processes (its launcher set MASTER_PORT) but started "
            f"only this one, {alone} On CPUs accelerate starts several processes only with --multi_gpu: "
            "accelerate launch --multi_gpu --num_processes 2 SCRIPT (docs/integrations.md), or torchrun "
            "--nproc-per-node 2 SCRIPT."
        )
    return None
