"""Start and end the torch.distributed process group of a job, from the launcher's environment.

By default this is torch's env:// start (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT), with its TCP rendezvous store. A one-machine job launched by hand can instead set
``DISTRO_OPT_RENDEZVOUS_FILE`` to a fresh path (plus RANK and WORLD_SIZE): the ranks then meet
through a ``torch.distributed.FileStore`` in that file, and nothing listens on a port for them.
The tests launch their ranks this way. A TCP store's clients also look up a name for the
store's address (torch does it for its log lines). Where /etc/hosts lacks an entry for the
IPv4-mapped address they connect through, that lookup is a DNS query off the machine, even for
127.0.0.1.
"""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist

RENDEZVOUS_FILE = "DISTRO_OPT_RENDEZVOUS_FILE"


def start_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group(backend)`` from the environment; end it with destroy_process_group."""
    path = os.environ.get(RENDEZVOUS_FILE)
    if path is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{RENDEZVOUS_FILE} is set but {' and '.join(missing)} not: set RANK (0 .. WORLD_SIZE-1) "
            "and WORLD_SIZE in every process of the job"
        )
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(path, world_size)
    store.set_timeout(timeout)
    dist.init_process_group(
        backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size, timeout=timeout
    )


def one_machine_env(rank: int, world_size: int, rendezvous_file) -> dict[str, str]:
    """The variables of rank ``rank`` of a one-machine job launched by hand (add them to the rest of
    its environment): rank and world size, the rendezvous file, and Gloo's own sockets on loopback."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        RENDEZVOUS_FILE: str(rendezvous_file),
        "GLOO_SOCKET_IFNAME": "lo",
    }


def single_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """A group of one process, whose store lives in memory: nothing listens on any port."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
