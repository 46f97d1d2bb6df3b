"""experiments.run as hand-launched torch.distributed ranks: a start that fails on one rank leaves
--out untouched, a peer that dies mid-run makes the other print one line, exit 1 and delete the
rendezvous file, and Ctrl-C is one line and exit 130 on every rank. Ranks are real processes (Gloo
on 127.0.0.1, the rendezvous in a file), each bounded by a wall-clock timeout; whatever is left is
killed on the way out.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from distro_opt.experiments.process_group import one_machine_env

from _procs import wait_all
from _ranks import run_args, start_ranks


def test_a_start_that_fails_on_another_rank_leaves_out_untouched(corpus, tmp_path):
    out = tmp_path / "run"  # rank 1's corpus cache is missing, as on a second machine without it
    rank_args = [run_args(corpus, out), run_args(corpus, out, cache=tmp_path / "no-cache")]
    for code, err in wait_all(start_ranks(tmp_path, rank_args, tmp_path / "rendezvous"), 60):
        assert code == 2 and err.startswith("error: Corpus ") and "is not prepared in" in err, err
        assert err.count("\n") == 1, err
    assert not out.exists()  # the same command can run once the cache is there: no run to --resume


def _wait_for_training(out, procs):
    deadline = time.monotonic() + 60
    while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").stat().st_size == 0:
        assert time.monotonic() < deadline and procs[0].poll() is None, "rank 0 never started training"
        time.sleep(0.1)


def test_a_peer_dying_mid_run_is_one_line_and_exit_1_and_the_rendezvous_file_is_deleted(corpus, tmp_path):
    out, rendezvous = tmp_path / "run", tmp_path / "rendezvous"
    procs = start_ranks(tmp_path, [run_args(corpus, out, steps=100000)] * 2, rendezvous)
    _wait_for_training(out, procs)
    procs[1].send_signal(signal.SIGKILL)
    (code, err), (killed, _) = wait_all(procs, 30)
    assert killed == -signal.SIGKILL
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("rank 0 of 2: ") and " did not complete (" in err, err
    assert err.endswith("; continue with the same command plus --resume\n"), err
    assert not rendezvous.exists()


def test_ctrl_c_mid_run_is_one_line_and_exit_130_on_every_rank(corpus, tmp_path):
    out, rendezvous = tmp_path / "run", tmp_path / "rendezvous"
    procs = start_ranks(tmp_path, [run_args(corpus, out, steps=100000)] * 2, rendezvous)
    _wait_for_training(out, procs)
    for p in procs:  # as a terminal's Ctrl-C: every process of the job at once
        p.send_signal(signal.SIGINT)
    for rank, (code, err) in enumerate(wait_all(procs, 30)):
        assert code == 130, err
        assert err == f"rank {rank} of 2: interrupted; continue with the same command plus --resume\n", err
    assert not rendezvous.exists()


DIES_LOADING = """
import os, runpy, signal, sys
from distro_opt.experiments import distributed
if os.environ["RANK"] == "1":  # as the OOM killer while the corpus loads, before --out is touched
    distributed.load_corpus = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
sys.argv = ["experiments.run", *sys.argv[1:]]
runpy.run_module("distro_opt.experiments.run", run_name="__main__", alter_sys=True)
"""


def test_a_peer_lost_before_out_holds_the_run_advises_the_same_command_not_resume(corpus, tmp_path):
    out, rendezvous = tmp_path / "run", tmp_path / "rendezvous"
    procs = [subprocess.Popen([sys.executable, "-c", DIES_LOADING, *map(str, run_args(corpus, out))],
                              cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                 **one_machine_env(rank, 2, rendezvous)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    (code, err), (killed, _) = wait_all(procs, 30)
    assert killed == -signal.SIGKILL
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("rank 0 of 2: the start-up all_gather did not complete ("), err
    assert err.endswith("; run the same command again\n"), err  # --resume would say: nothing to resume
    assert not out.exists()
    assert not rendezvous.exists()
