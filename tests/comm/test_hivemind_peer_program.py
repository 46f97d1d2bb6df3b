"""The peer program's replica guard (distro_opt/volunteer) in this process, on a real backend on 127.0.0.1."""

import json
import logging
import os
import uuid

import pytest

pytest.importorskip("hivemind")

from distro_opt.comm.hivemind_backend import HivemindBackend  # noqa: E402
from distro_opt import volunteer  # noqa: E402


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
def test_every_published_checksum_is_compared_two_steps_later(dht, every, published, compared):
    backends = []

    def make_backend(args):
        backends.append(ChecksumSpy(args.run_id, dht=dht, heartbeat_s=0.3, ttl_s=1.5, step_timeout_s=2.0))
        return backends[-1]

    level = logging.getLogger("distro_opt").level  # run() configures logging for a program
    try:
        argv = ["--run-id", f"t{uuid.uuid4().hex[:10]}", "--steps", "6", "--checksum-every", str(every)]
        args = volunteer.parse_args(argv + ["--linger-s", "0", "--wait-peers-s", "0"])
        assert volunteer.run(args, make_backend=make_backend) == 0
    finally:
        logging.getLogger("distro_opt").setLevel(level)
    (spy,) = backends
    assert (spy.published, spy.compared) == (published, compared)


@pytest.fixture
def program(dht, monkeypatch):
    """``volunteer.run`` in this process, its backend on the module's DHT; returns (exit code, stdout,
    stderr) of one run. ``on_start(args)`` runs when the backend is made (after the input checks);
    ``after_step`` is passed to ``volunteer.run``."""

    def run(capsys, *argv, on_start=None, after_step=None):
        def make_backend(args):
            if on_start is not None:
                on_start(args)
            return HivemindBackend(args.run_id, dht=dht, heartbeat_s=0.3, ttl_s=1.5, step_timeout_s=2.0)

        monkeypatch.setenv("HIVEMIND_LOGLEVEL", "ERROR")
        level = logging.getLogger("distro_opt").level
        try:
            args = volunteer.parse_args(["--run-id", f"t{uuid.uuid4().hex[:10]}", "--linger-s", "0", *argv])
            code = volunteer.run(args, make_backend=make_backend, after_step=after_step)
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
    assert err.startswith("error: no peer of run ") and "served a state" in err, err
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


def test_after_step_runs_after_every_step_and_what_it_changes_is_trained_on(program, capsys, tmp_path):
    def summary(name, after_step=None):
        out_file = tmp_path / name
        code, _, err = program(capsys, "--steps", "3", "--wait-peers-s", "0", "--checksum-every", "0",
                               "--out", str(out_file), after_step=after_step)
        assert code == 0, err
        return json.loads(out_file.read_text())

    seen = []

    def nudge_at_step_1(step, model):
        seen.append(step)
        if step == 1:
            next(model.parameters()).data.add_(1e-3)

    plain, plain_again, nudged = summary("a.json"), summary("b.json"), summary("c.json", nudge_at_step_1)
    assert seen == [0, 1, 2]
    assert plain["checksum"] == plain_again["checksum"]  # one peer alone: the run is deterministic
    assert nudged["checksum"] != plain["checksum"]
