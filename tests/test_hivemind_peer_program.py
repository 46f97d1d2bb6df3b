"""The peer program's replica guard (experiments/peer.py) in this process, on a real backend on 127.0.0.1."""

import json
import logging
import os
import uuid

import pytest

pytest.importorskip("hivemind")

from distro_opt.comm.hivemind_backend import HivemindBackend  # noqa: E402
from distro_opt.experiments import peer  # noqa: E402


import _hm_local as local  # noqa: E402
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def dht(tmp_path_factory):
    (node,) = local.start_dhts(1, tmp_path_factory.mktemp("identity"))
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


@pytest.fixture
def program(dht, monkeypatch):
    """``peer.main`` in this process, its backend on the module's DHT; returns (exit code, stdout,
    stderr) of one run. ``on_start(args)`` runs when the backend is made (after the input checks)."""

    def run(capsys, *argv, on_start=None):
        def make_backend(args):
            if on_start is not None:
                on_start(args)
            return HivemindBackend(args.run_id, dht=dht, heartbeat_s=0.3, ttl_s=1.5, step_timeout_s=2.0)

        monkeypatch.setattr(peer, "make_backend", make_backend)
        monkeypatch.setenv("HIVEMIND_LOGLEVEL", "ERROR")
        level = logging.getLogger("distro_opt").level
        try:
            code = peer.main(["--run-id", f"t{uuid.uuid4().hex[:10]}", "--linger-s", "0", *argv])
        finally:
            logging.getLogger("distro_opt").setLevel(level)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_fewer_peers_than_min_peers_is_a_warning_on_stderr(program, capsys):
    code, out, err = program(capsys, "--steps", "1", "--min-peers", "3", "--wait-peers-s", "0.5")
    assert code == 0, err
    assert err.strip() == (
        "warning: 1 of --min-peers 3 peers arrived within --wait-peers-s 0.5; "
        "training with 1 (later peers can still --join)"
    )
    assert "step 0 | " in out


def test_join_with_no_peer_to_serve_state_is_one_line_and_exit_1(program, capsys, tmp_path):
    nobody = "/ip4/127.0.0.1/tcp/1/p2p/QmXLZSLDpgE6C2WEGEXBQ4nGmDFqpKWwm3wrXNWGWPtu2z"  # not dialled here
    out_file = tmp_path / "summary.json"
    code, out, err = program(capsys, "--join", "--initial-peers", nobody, "--wait-peers-s", "0",
                             "--out", str(out_file))
    assert code == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: no peer of run ") and "served its state" in err, err
    assert not out_file.exists()


def test_the_outputs_are_written_as_new_files(program, capsys, tmp_path):
    out_file, maddrs_file = tmp_path / "summary.json", tmp_path / "maddrs"
    code, out, err = program(capsys, "--steps", "2", "--wait-peers-s", "0", "--out", str(out_file),
                             "--maddrs-file", str(maddrs_file))
    assert code == 0, err
    assert json.loads(out_file.read_text())["final_step"] == 2
    assert maddrs_file.read_text().split() == out.splitlines()[0].split()[3:]  # what "peer ... maddrs" says
    assert sorted(os.listdir(tmp_path)) == ["maddrs", "summary.json"]


def test_an_out_file_that_appears_during_the_run_is_not_overwritten(program, capsys, tmp_path):
    out_file = tmp_path / "summary.json"
    code, out, err = program(capsys, "--steps", "1", "--wait-peers-s", "0", "--out", str(out_file),
                             on_start=lambda args: out_file.write_text("theirs"))
    assert code == 1, err
    assert err == f"error: {out_file} appeared while the peer ran; not overwritten\n"
    assert out_file.read_text() == "theirs"
