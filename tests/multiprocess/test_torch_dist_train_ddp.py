"""experiments.train_ddp's start-up: checkpoints refused before training, written whole or not at
all, rank files of one save only; ranks that would train different models refused; bad arguments
as one line. Multi-process tests launch real ranks (Gloo on 127.0.0.1, the rendezvous in a file),
each bounded by a wall-clock timeout; whatever is left is killed on the way out.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distro_opt.comm import InProcessBackend, SingleWorkerBackend
from distro_opt.experiments import train_ddp
from distro_opt.experiments.process_group import one_machine_env
from distro_opt.experiments.train_ddp import TrainConfig, train

from _procs import default_sigint, wait_all


def two_ranks(tmp_path, rank_args, timeout_s=40):
    """``python -m experiments.train_ddp`` as 2 hand-launched ranks; [(exit code, stderr)] per rank."""
    rendezvous, procs = tmp_path / f"rendezvous{time.monotonic_ns()}", []
    for rank, args in enumerate(rank_args):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **one_machine_env(rank, 2, rendezvous)}
        procs.append(subprocess.Popen([sys.executable, "-m", "distro_opt.experiments.train_ddp", "--no-log",
                                       "--timeout-s", "20", *map(str, args)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return wait_all(procs, timeout_s)


def one_line_error_on_every_rank(results, text):
    for code, err in results:
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
        assert text in err, err


# -- --save-dir ----------------------------------------------------------------------------------


def test_a_save_dir_holding_a_checkpoint_is_refused_before_the_first_step(tmp_path):
    train(TrainConfig(steps=1, log=False, save_dir=str(tmp_path)), SingleWorkerBackend())
    steps = []
    with pytest.raises(FileExistsError, match=f"--save-dir {tmp_path} already holds a checkpoint "
                                              r"\(rank0.pt\); choose an empty directory"):
        train(TrainConfig(steps=3, save_dir=str(tmp_path)), SingleWorkerBackend(), log=steps.append)
    assert steps == []


def test_a_save_cut_short_leaves_no_checkpoint_file(tmp_path, monkeypatch):
    def cut_short(obj, f):  # a kill or a full disk halfway through the write
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(OSError, match="No space left"):
        train(TrainConfig(steps=1, log=False, save_dir=str(tmp_path)), SingleWorkerBackend())
    assert list(tmp_path.iterdir()) == []  # no torn rank0.pt that resuming would trip over
    monkeypatch.undo()
    train(TrainConfig(steps=1, log=False, save_dir=str(tmp_path)), SingleWorkerBackend())
    assert [f.name for f in tmp_path.iterdir()] == ["rank0.pt"]


def _no_hard_links(monkeypatch):
    def link(src, dst, **kwargs):  # as on FAT/exFAT, s3fs/gcsfuse, SMB without unix extensions
        raise PermissionError(errno.EPERM, "Operation not permitted", str(src), None, str(dst))

    monkeypatch.setattr(os, "link", link)


def test_a_save_without_hard_links_renames_and_still_never_overwrites(tmp_path, monkeypatch):
    _no_hard_links(monkeypatch)
    train(TrainConfig(steps=1, log=False, save_dir=str(tmp_path)), SingleWorkerBackend())
    assert [f.name for f in tmp_path.iterdir()] == ["rank0.pt"]
    from distro_opt.experiments.ddp_checkpoint import _publish

    saved = (tmp_path / "rank0.pt").read_bytes()
    (tmp_path / "new.part").write_bytes(b"another save")
    with pytest.raises(FileExistsError):
        _publish(tmp_path / "new.part", tmp_path / "rank0.pt")
    assert (tmp_path / "rank0.pt").read_bytes() == saved


def test_a_save_dir_where_no_file_can_be_named_is_refused_before_the_first_step(tmp_path, monkeypatch):
    _no_hard_links(monkeypatch)

    def rename(src, dst, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "rename", rename)
    steps = []
    with pytest.raises(PermissionError, match=f"--save-dir {tmp_path} cannot hold a checkpoint: writing a "
                                              r"file there failed \(Operation not permitted\)"):
        train(TrainConfig(steps=3, save_dir=str(tmp_path)), SingleWorkerBackend(), log=steps.append)
    assert steps == []  # found before training, not after the whole run
    assert list(tmp_path.iterdir()) == []  # the probe is gone too


def test_the_part_file_of_a_killed_save_is_deleted_by_the_next_check_but_not_one_being_written(tmp_path):
    import fcntl

    from distro_opt.experiments.ddp_checkpoint import check_save_dir

    (tmp_path / ".rank1.pt.0123456789abcdef.part").write_bytes(b"PK\x03\x04 half a zip")
    writing = tmp_path / ".rank0.pt.fedcba9876543210.part"
    with open(writing, "wb") as f:  # a save in progress holds its part file locked
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        check_save_dir(str(tmp_path))
        assert [f.name for f in tmp_path.iterdir()] == [writing.name]


def test_the_folder_of_a_killed_sharded_save_is_deleted_by_the_next_check_but_not_one_being_written(tmp_path):
    import fcntl

    from distro_opt.experiments.ddp_checkpoint import check_save_dir

    for name in ("0123456789abcdef", "fedcba9876543210"):  # DCP folders without rank files naming them
        (tmp_path / f"sharded-{name}").mkdir()
        (tmp_path / f"sharded-{name}" / "__0_0.distcp").write_bytes(b"half a shard")
    (tmp_path / ".sharded.0123456789abcdef.part").write_bytes(b"")  # its save died: nobody holds it
    writing = tmp_path / ".sharded.fedcba9876543210.part"
    with open(writing, "wb") as f:  # rank 0 of a save in progress holds its folder's lock file
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        check_save_dir(str(tmp_path))
        assert sorted(f.name for f in tmp_path.iterdir()) == [writing.name, "sharded-fedcba9876543210"]
        assert (tmp_path / "sharded-fedcba9876543210" / "__0_0.distcp").read_bytes() == b"half a shard"


@pytest.fixture(params=["deletes", "holds"])
def cleanup_in_the_gap(request, monkeypatch):
    """Another rank's check_save_dir of the same directory meets the first file ddp_checkpoint creates
    ("xb") between its creation and its lock: the whole cleanup runs then (it locks the new file,
    deletes it, unlocks: "deletes"), or the cleanup is midway, holding the lock on the file it has
    just deleted ("holds"). Yields the names of the files it met."""
    import fcntl

    from distro_opt.experiments import ddp_checkpoint

    met, held = [], []

    def cleanup(path):
        if request.param == "deletes":
            ddp_checkpoint._remove_leftovers(path.parent)
            return
        f = open(path, "rb")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink()
        held.append(f)

    def create_then_cleanup(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if mode == "xb" and not met:
            met.append(Path(path).name)
            cleanup(Path(path))
        return f

    monkeypatch.setattr(ddp_checkpoint, "open", create_then_cleanup, raising=False)
    yield met
    for f in held:
        f.close()


def test_a_probe_that_another_ranks_cleanup_takes_for_a_leftover_is_made_again(tmp_path, cleanup_in_the_gap):
    from distro_opt.experiments.ddp_checkpoint import check_save_dir

    check_save_dir(str(tmp_path))
    assert len(cleanup_in_the_gap) == 1 and cleanup_in_the_gap[0].startswith(".probe.")  # it happened
    assert list(tmp_path.iterdir()) == []


def test_a_save_whose_part_file_another_ranks_cleanup_takes_for_a_leftover_still_saves(tmp_path,
                                                                                      cleanup_in_the_gap):
    from distro_opt.experiments.ddp_checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    save_checkpoint(str(tmp_path), 0, 1, 5, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(cleanup_in_the_gap) == 1 and cleanup_in_the_gap[0].startswith(".rank0.pt.")
    assert [f.name for f in tmp_path.iterdir()] == ["rank0.pt"]
    assert torch.load(tmp_path / "rank0.pt", weights_only=False)["step"] == 5


def test_a_checkpoint_on_one_rank_stops_every_rank_at_start_with_one_line(tmp_path):
    held = tmp_path / "b"
    train(TrainConfig(steps=1, log=False, save_dir=str(held)), SingleWorkerBackend())
    t0 = time.monotonic()
    results = two_ranks(tmp_path, [["--steps", "100000", "--save-dir", tmp_path / "a"],  # each its own disk
                                   ["--steps", "100000", "--save-dir", held]])
    one_line_error_on_every_rank(results, f"rank 1: --save-dir {held} already holds a checkpoint (rank0.pt)")
    assert time.monotonic() - t0 < 30  # 100000 steps were not run first


def test_ranks_saving_after_no_step_do_not_refuse_each_others_new_files(tmp_path, monkeypatch):
    # train(steps=0) as a library call (e.g. resharding a checkpoint): no collective orders one rank's
    # check of --save-dir before another rank's save. The slower rank checks after the other saved.
    real, calls = train_ddp.check_save_dir, []

    def slow_second_check(directory):
        calls.append(directory)
        if len(calls) == 2:
            deadline = time.monotonic() + 5
            while not list(tmp_path.glob("rank*.pt")) and time.monotonic() < deadline:
                time.sleep(0.01)
        real(directory)

    monkeypatch.setattr(train_ddp, "check_save_dir", slow_second_check)
    cfg = TrainConfig(steps=0, log=False, save_dir=str(tmp_path))
    InProcessBackend.run(2, lambda backend: train(cfg, backend), timeout_s=30)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["rank0.pt", "rank1.pt"]


# -- --resume-dir --------------------------------------------------------------------------------


def save_two_ranks(directory, steps, seed=0):
    cfg = TrainConfig(steps=steps, seed=seed, log=False, save_dir=str(directory))
    InProcessBackend.run(2, lambda backend: train(cfg, backend), timeout_s=60)


def test_rank_files_of_different_saves_are_refused_naming_them(tmp_path):
    save_two_ranks(tmp_path / "a", 2)
    save_two_ranks(tmp_path / "b", 3, seed=1)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "a" / "rank0.pt", mixed)
    shutil.copy(tmp_path / "b" / "rank1.pt", mixed)
    with pytest.raises(ValueError, match=rf"Checkpoint files in '{mixed}' are not from one save: "
                                         r"rank0.pt \(step 2, 2 ranks, params \w+\), "
                                         r"rank1.pt \(step 3, 2 ranks, params \w+\)"):
        train(TrainConfig(steps=1, log=False, resume_dir=str(mixed)), SingleWorkerBackend())


def test_ranks_resuming_from_different_checkpoints_are_refused_before_training(tmp_path):
    # Each rank's directory is one save's (as on two machines), but not the same save's.
    for name, seed in (("a", 0), ("b", 1)):
        cfg = TrainConfig(steps=1, seed=seed, log=False, save_dir=str(tmp_path / name))
        train(cfg, SingleWorkerBackend())
    results = two_ranks(tmp_path, [["--resume-dir", tmp_path / "a"], ["--resume-dir", tmp_path / "b"]])
    one_line_error_on_every_rank(results, "the ranks start from different parameters (checksums: rank 0: ")


def test_ranks_started_with_different_arguments_are_refused(tmp_path):
    results = two_ranks(tmp_path, [["--seed", "0"], ["--seed", "1"]])
    one_line_error_on_every_rank(results, "the ranks were started with different arguments (seed: 0, 1)")


def test_ctrl_c_on_every_rank_is_one_line_and_exit_130_and_the_rendezvous_file_is_deleted(tmp_path):
    rendezvous, log = tmp_path / "rendezvous", tmp_path / "rank0.log"
    with open(log, "w") as out:
        procs = [subprocess.Popen([sys.executable, "-m", "distro_opt.experiments.train_ddp",
                                   "--steps", "100000", "--timeout-s", "20", *([] if rank == 0 else ["--no-log"])],
                                  env={**os.environ, "OMP_NUM_THREADS": "1",
                                       **one_machine_env(rank, 2, rendezvous)},
                                  stdout=out, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
                 for rank in range(2)]
        deadline = time.monotonic() + 30
        while "step    3 |" not in log.read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        for p in procs:  # as a terminal's Ctrl-C: every process of the job at once
            p.send_signal(signal.SIGINT)
        results = wait_all(procs, 30)
    for rank, (code, err) in enumerate(results):
        assert code == 130 and err == f"rank {rank}: interrupted\n", err
    assert not rendezvous.exists()


def test_a_rank_whose_peer_never_comes_is_one_line_and_exit_1(tmp_path):
    rendezvous = tmp_path / "rendezvous"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **one_machine_env(0, 2, rendezvous)}  # rank 1 never starts
    (code, err), = wait_all([subprocess.Popen([sys.executable, "-m", "distro_opt.experiments.train_ddp",
                                               "--timeout-s", "2"], env=env, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.PIPE, text=True)], 40)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("rank 0: the process group did not start ("), err
    assert not rendezvous.exists()


# -- arguments -----------------------------------------------------------------------------------


@pytest.fixture
def no_group_left():
    yield
    if dist.is_initialized():  # the code before the fix started a group, then raised
        dist.destroy_process_group()


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "float16"], "Invalid dtype: 'float16'"),
    (["--steps", "-1"], "Invalid steps: -1"),
    (["--inject-inf", "1:x"], "Invalid inject_inf: '1:x'"),
    (["--timeout-s", "0"], "Invalid timeout_s: 0.0"),
    (["--hidden", "0"], "Invalid hidden: 0 (expected >= 1)"),
    pytest.param(["--device", "cuda"], "device cuda needs a CUDA GPU and a torch build with NCCL",
                 marks=pytest.mark.skipif(torch.cuda.is_available() and dist.is_nccl_available(),
                                          reason="CUDA and NCCL are here")),
], ids=["dtype", "steps", "inject-inf", "timeout-s", "hidden", "device-cuda"])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, monkeypatch, no_group_left):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train_ddp.main(argv + ["--steps", "1"] if argv[0] != "--steps" else argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"experiments.train_ddp: error: {message}") and err.count("\n") == 1, err


def test_help_prints_the_scripts_docstring_and_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_ddp.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.count("Train a small MLP with DisTrOAdamW across real processes") == 1
    assert "--shard-degree SHARD_DEGREE" in out and "the world size a multiple of S" in out
