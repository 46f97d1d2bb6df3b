"""Test helper: HivemindBackends in this process, each on its own DHT, all on 127.0.0.1.

Shared by the ``test_hivemind_*`` modules that run peers in one process. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import hivemind
import pytest
import torch

from distro_opt.comm.hivemind_backend import HivemindBackend, dht_options

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
STEP_TIMEOUT_S = 2.0
# for tests where every peer takes part and none is meant to miss a deadline: the rounds end as soon
# as every payload and vote is in, so a roomy deadline costs nothing, and a loaded machine that
# takes over a second to open a stream no longer drops a payload the test expects
ROOMY_STEP_TIMEOUT_S = 8.0


def dhts_fixture(n: int):
    """A module-scoped pytest fixture of ``start_dhts(n)``, shut down after the module's tests."""
    @pytest.fixture(scope="module")
    def dhts(tmp_path_factory):
        nodes = start_dhts(n, tmp_path_factory.mktemp("identities"))
        yield nodes
        for dht in nodes:
            dht.shutdown()

    return dhts


def start_dhts(n: int, identities) -> list:
    """``n`` DHT nodes on loopback, all bootstrapped from the first (shut them down when done); node
    ``i`` has the libp2p identity ``identities/i.key`` (written by hivemind), which a backend on it
    signs its records with."""
    options = dht_options([LOOPBACK], None)  # what a HivemindBackend would start with

    def node(i, **kwargs):
        path = str(Path(identities) / f"{i}.key")
        return hivemind.DHT(start=True, host_maddrs=[LOOPBACK], identity_path=path, **options, **kwargs)

    first = node(0)
    maddrs = [str(m) for m in first.get_visible_maddrs()]
    assert all(m.startswith("/ip4/127.0.0.1/") for m in maddrs)
    return [first, *(node(i, initial_peers=maddrs) for i in range(1, n))]


@contextmanager
def group(dhts, n=3, options=None, wait=True, classes=None, step_timeout_s=STEP_TIMEOUT_S):
    """``n`` backends of a fresh run on the shared DHTs; ``options[i]`` are extra kwargs of backend i,
    ``classes[i]`` a subclass to use for it (a misbehaving peer)."""
    run_id = f"t{uuid.uuid4().hex[:10]}"
    backends = []
    try:
        for i in range(n):
            kwargs = dict(step_timeout_s=step_timeout_s, heartbeat_s=0.3, ttl_s=1.5, exclude_s=30.0)
            kwargs.update((options or {}).get(i, {}))
            cls = (classes or {}).get(i, HivemindBackend)
            backends.append(cls(run_id, dht=dhts[i], **kwargs))
        if wait:
            wait_all(backends, n - 1)
        yield backends
    finally:
        for b in backends:
            b.close()


def wait_all(backends, n):
    """Every backend announces itself and waits for ``n`` others (in parallel, as separate peers would);
    ``n`` may be a list, one count per backend."""
    counts = [None] * len(backends)
    wanted = list(n) if isinstance(n, (list, tuple)) else [n] * len(backends)

    def run(i):
        counts[i] = backends[i].wait_for_peers(wanted[i], 10)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert counts == wanted


def wait_all_visible(backends, timeout_s=10.0):
    """Every backend announces itself; wait until each one's view lists as active all the others
    its allow list admits (a private run's view holds no stranger)."""
    for b in backends:
        b.wait_for_peers(0, 0)
    deadline = time.monotonic() + timeout_s

    def visible(b):
        active = {p for p, rec in b.membership.view().items() if rec.state == "active"}
        return {o.peer_id for o in backends if o is not b and b.membership.allowed(o.peer_id)} <= active

    while not all(visible(b) for b in backends):
        assert time.monotonic() < deadline, "the peers did not see each other"
        time.sleep(0.1)


def gather(pairs, timeout_s=3 * STEP_TIMEOUT_S + 5):
    """Run ``backend.all_gather(buf)`` for each (backend, buf) on its own thread; return results and times."""
    results, times = [None] * len(pairs), [None] * len(pairs)

    def run(i, backend, buf):
        t0 = time.monotonic()
        results[i] = backend.all_gather(buf)
        times[i] = time.monotonic() - t0

    threads = [
        threading.Thread(target=run, args=(i, b, buf), daemon=True) for i, (b, buf) in enumerate(pairs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert all(r is not None for r in results), "a gather did not return"
    return results, times


def filled(value, n=1000):
    return torch.full((n,), value, dtype=torch.uint8)


def firsts(bufs):
    return [int(b[0]) for b in bufs]


def gather_at(triples, timeout_s=3 * STEP_TIMEOUT_S + 5):
    """Like ``gather`` for ``(backend, buf, offset_s)``: each gather starts ``offset_s`` after a common
    start (a peer slower than the others); returns results and each gather's own duration."""
    start = time.monotonic() + 0.2

    def delayed(backend, offset):
        class Later:
            def all_gather(self, buf):
                time.sleep(max(0.0, start + offset - time.monotonic()))
                t0 = time.monotonic()
                out = backend.all_gather(buf)
                durations[id(backend)] = time.monotonic() - t0
                return out

        return Later()

    durations = {}
    results, _ = gather([(delayed(b, off), buf) for b, buf, off in triples], timeout_s)
    return results, [durations[id(b)] for b, _, _ in triples]
