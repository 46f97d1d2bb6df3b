"""The peer program's replica guard (experiments/peer.py) in this process, on a real backend on 127.0.0.1."""

import logging
import uuid

import pytest

pytest.importorskip("hivemind")

from distro_opt.comm.hivemind_backend import HivemindBackend  # noqa: E402
from distro_opt.experiments import peer  # noqa: E402


import _hm_local as local  # noqa: E402
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def dht():
    (node,) = local.start_dhts(1)
    yield node
    node.shutdown()


class ChecksumSpy(HivemindBackend):
    """A real backend that records the steps whose checksums it publishes and compares."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.published, self.compared = [], []

    def publish_checksum(self, step, checksum):
        self.published.append(step)
        super().publish_checksum(step, checksum)

    def compare_checksum(self, step, checksum):
        self.compared.append(step)
        return super().compare_checksum(step, checksum)


@pytest.mark.parametrize(
    "every,published,compared",
    [(1, [0, 1, 2, 3, 4, 5], [0, 1, 2, 3]), (2, [1, 3, 5], [1, 3]), (3, [2, 5], [2])],
)
def test_every_published_checksum_is_compared_two_steps_later(dht, monkeypatch, every, published, compared):
    backends = []

    def make_backend(args):
        backends.append(ChecksumSpy(args.run_id, dht=dht, heartbeat_s=0.3, ttl_s=1.5, step_timeout_s=2.0))
        return backends[-1]

    monkeypatch.setattr(peer, "make_backend", make_backend)
    level = logging.getLogger("distro_opt").level  # main() configures logging for a program
    try:
        argv = ["--run-id", f"t{uuid.uuid4().hex[:10]}", "--steps", "6", "--checksum-every", str(every)]
        assert peer.main(argv + ["--linger-s", "0", "--wait-peers-s", "0"]) == 0
    finally:
        logging.getLogger("distro_opt").setLevel(level)
    (spy,) = backends
    assert (spy.published, spy.compared) == (published, compared)
