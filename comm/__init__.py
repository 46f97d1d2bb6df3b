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

from .base import Backend, CommStats, PendingGather, SingleWorkerBackend
from .inprocess import InProcessBackend, InProcessGroupError

__all__ = [
    "Backend",
    "CommStats",
    "PendingGather",
    "SingleWorkerBackend",
    "InProcessBackend",
    "InProcessGroupError",
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


def resolve_backend(comm=None, process_group=None) -> Backend:
    """Turn what a user passed as ``comm=`` (or ``process_group=``) into a ``Backend``.

    ``None``: torch.distributed's default group when it is initialized, else a single worker.
    A ``Backend`` is used as it is; a torch.distributed ``ProcessGroup`` is wrapped.
    """
    if comm is not None and process_group is not None:
        raise ValueError("Pass either comm= or process_group=, not both")
    target = comm if comm is not None else process_group
    if isinstance(target, Backend):
        return target
    import torch.distributed as dist

    if target is None:
        if dist.is_available() and dist.is_initialized():
            from .torch_backend import TorchDistributedBackend

            return TorchDistributedBackend()
        return SingleWorkerBackend()
    if dist.is_available() and isinstance(target, dist.ProcessGroup):
        from .torch_backend import TorchDistributedBackend

        return TorchDistributedBackend(group=target)
    raise TypeError(
        f"Invalid comm: {type(target).__name__} (expected None, a distro_opt.comm.Backend "
        "or a torch.distributed ProcessGroup)"
    )
