"""distro-peer's command line (distro_opt/volunteer): bad input is one ``error:`` line, exit status 2,
refused before the DHT starts; the output files are never overwritten; a run that cannot start is one
line, exit status 1. Only 127.0.0.1 is used (an unreachable peer is port 1 on loopback)."""

import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("hivemind")

from distro_opt import volunteer  # noqa: E402
from distro_opt.volunteer.outputs import write_new  # noqa: E402

pytestmark = pytest.mark.timeout(60)

PEER_ID = "QmXLZSLDpgE6C2WEGEXBQ4nGmDFqpKWwm3wrXNWGWPtu2z"
NOBODY = f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}"  # a well-formed address where nothing listens


def refuse_to_start(args):
    """A ``make_backend`` that fails the test if reached: bad input must be refused before the DHT
    (and its p2p daemon) starts."""
    raise AssertionError("the DHT was started before the input was refused")


@pytest.fixture
def restored_logging(monkeypatch):
    """The program's logging settings, restored after a ``run_main``."""
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "ERROR")  # main() sets it only where unset
    level = logging.getLogger("distro_opt").level  # main() configures logging for a program
    yield
    logging.getLogger("distro_opt").setLevel(level)


def run_main(capsys, *argv):
    """``volunteer.run`` in this process, as ``distro-peer --run-id cli ARGV`` but with a backend
    that fails the test if it is started."""
    try:
        code = volunteer.run(volunteer.parse_args(["--run-id", "cli", *argv]), make_backend=refuse_to_start)
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(err: str, expected: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(("error: ", "distro-peer: error: ")), err
    assert expected in lines[0], err


BAD_INPUT = [
    (["--preset", "foo"], "invalid choice: 'foo'"),
    (["--host-maddrs", "garbage"], "--host-maddrs: invalid multiaddress 'garbage'"),
    (["--initial-peers", "garbage"], "--initial-peers: invalid multiaddress 'garbage'"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1"], "does not end in /p2p/PEER_ID"),
    (["--allow-peers", "garbage"], "--allow-peers: invalid peer id 'garbage'"),
    (["--lr", "-1"], "argument --lr: '-1': expected a number >= 0"),
    (["--lr", "nan"], "argument --lr: 'nan': expected a finite number"),
    (["--step-timeout-s", "0"], "argument --step-timeout-s: '0': expected a number > 0"),
    (["--wait-peers-s", "inf"], "argument --wait-peers-s: 'inf': expected a finite number"),
    (["--heartbeat-s", "5"], "Invalid heartbeat"),  # not below --ttl-s 4
    (["--run-id", "bad id!"], "Invalid run_id: 'bad id!'"),
    (["--preset", "smoke", "--num-shards", "0"], "argument --num-shards: '0': expected a number >= 1"),
    (["--preset", "smoke", "--shard", "8"], "--shard 8 is out of range for --num-shards 8"),
    (["--steps", "0"], "argument --steps: '0': expected a number >= 1"),
    (["--min-peers", "0"], "argument --min-peers: '0': expected a number >= 1"),
    (["--join", "--wait-peers-s", "3"], "--join needs --initial-peers"),
    (["--untrusted-fraction", "0.5"], "--untrusted-fraction 0.5: expected < 0.5"),
]


@pytest.mark.parametrize("argv,expected", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2_before_the_dht_starts(restored_logging, capsys, argv, expected):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == "", (code, out, err)
    assert_one_error_line(err, expected)


@pytest.mark.parametrize(
    "argv, fraction",
    [([], 0.25), (["--allow-peers", PEER_ID], 0.0), (["--allow-peers", PEER_ID, "--untrusted-fraction", "0.3"], 0.3)],
)
def test_a_run_open_to_strangers_aggregates_with_the_trimmed_mean(argv, fraction):
    from distro_opt.volunteer.args import untrusted_fraction

    assert untrusted_fraction(volunteer.parse_args(["--run-id", "cli", *argv])) == fraction


def test_missing_corpus_is_one_line_and_exit_2(restored_logging, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DISTRO_OPT_CACHE", str(tmp_path / "nothing-here"))
    code, out, err = run_main(capsys, "--preset", "smoke")
    assert code == 2, err
    assert_one_error_line(err, "is not prepared in")
    assert "python -m experiments.prepare" in err  # the command that fixes it


@pytest.mark.parametrize("flag", ["--out", "--maddrs-file"])
def test_an_existing_output_file_is_refused_before_anything_starts(restored_logging, capsys, tmp_path, flag):
    path = tmp_path / "keep.json"
    path.write_text("keep")
    code, out, err = run_main(capsys, flag, str(path))
    assert code == 2, err
    assert_one_error_line(err, f"{flag} {path} exists")
    assert path.read_text() == "keep"


def test_a_missing_output_directory_or_one_file_for_both_outputs_is_refused(
    restored_logging, capsys, tmp_path
):
    code, _, err = run_main(capsys, "--out", str(tmp_path / "no" / "summary.json"))
    assert code == 2
    assert_one_error_line(err, f"directory {tmp_path / 'no'} does not exist")
    same = str(tmp_path / "same")
    code, _, err = run_main(capsys, "--out", same, "--maddrs-file", same)
    assert code == 2
    assert_one_error_line(err, "--out and --maddrs-file both name")
    assert os.listdir(tmp_path) == []


def test_write_new_writes_a_whole_new_file_and_never_replaces_one(tmp_path):
    path = tmp_path / "maddrs"
    write_new(path, "a\nb")
    assert path.read_text() == "a\nb"
    with pytest.raises(FileExistsError) as exc:
        write_new(path, "other")
    assert exc.value.filename == str(path)
    assert path.read_text() == "a\nb"
    assert os.listdir(tmp_path) == ["maddrs"]  # no temporary file left behind


def run_program(tmp_path, *argv, timeout_s=60):
    env = dict(os.environ, HIVEMIND_LOGLEVEL="ERROR", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    # cwd is not the repository root: comm/ must not be importable as a top-level package
    return subprocess.run(
        [sys.executable, "-m", "distro_opt.volunteer", "--run-id", "cli", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_the_program_refuses_bad_input_with_one_line(tmp_path):
    proc = run_program(tmp_path, "--host-maddrs", "garbage")
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert_one_error_line(proc.stderr, "--host-maddrs: invalid multiaddress 'garbage'")


def test_an_unreachable_initial_peer_is_one_line_and_exit_1(tmp_path):
    proc = run_program(tmp_path, "--initial-peers", NOBODY, "--out", "summary.json")
    assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert_one_error_line(proc.stderr, "cannot start this peer: Daemon failed to start: failed to connect")
    assert "check --initial-peers" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_help_names_the_defaults_and_no_test_only_option(capsys):
    with pytest.raises(SystemExit) as exc:
        volunteer.parse_args(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    for default in ("(default: 100)", "(default: 0.003)", "(default: synthetic)", "(default: 10.0)"):
        assert default in text, text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--step-delay-s" not in text and "--perturb-at-step" not in text
