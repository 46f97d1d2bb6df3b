"""The examples of docs/integrations.md, run as they are (2 or 4 Gloo ranks on 127.0.0.1; the plain
loop in this process), and DDP beside distro-opt.

Each multi-process example is launched once (tests/_example_rank.py records its steps) and the
tests below check, per example: the gradients were never all-reduced (they differ across ranks at
every step), the replicas end identical, the only gradient traffic is distro-opt's (its counters
match the payload formula exactly, and the process wrote far fewer bytes than one dense all-reduce
per step would send), and nothing warned.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import runpy
from pathlib import Path

import pytest
import torch

from distro_opt.comm import CommStats
from distro_opt.guards import CHECKSUM_NBYTES

from _ranks import HEADER_BYTES, expect_success, launch

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
RANK_SCRIPT = Path(__file__).resolve().parents[1].joinpath("_example_rank.py")
DDP_SCRIPT = Path(__file__).resolve().parents[1].joinpath("_ddp_beside_distro.py")
CHECKPOINTS_SCRIPT = Path(__file__).resolve().parents[1].joinpath("_two_rank_checkpoints.py")


def launch_script(script: Path, world_size: int, tmp: Path):
    """``world_size`` ranks of ``script`` under tests/_example_rank.py; ``(results, exit codes)``."""
    return launch([str(script)], world_size, tmp, timeout_s=240, worker=RANK_SCRIPT)


def _launch_example(name, world_size, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(name)
    results, codes = launch_script(EXAMPLES / f"{name}.py", world_size, tmp)
    return [r["example"] for r in expect_success(results, codes, tmp)]


@pytest.fixture(scope="module", params=["torchrun_loop", "accelerate_loop", "hf_trainer"])
def two_rank_example(request, tmp_path_factory):
    return request.param, _launch_example(request.param, 2, tmp_path_factory)


def torch_backend_bytes(payload_nbytes: int, steps: int, world_size: int) -> int:
    """What TorchDistributedBackend counts for a replica check, then ``steps`` payloads: the check's
    size announcement and framed checksum, the payload's size announcement (in the checksum's slot),
    then one framed payload per step."""
    check = CommStats.all_gather_bytes(HEADER_BYTES, world_size) + CommStats.all_gather_bytes(
        HEADER_BYTES + CHECKSUM_NBYTES, world_size)
    announce = CommStats.all_gather_bytes(HEADER_BYTES + CHECKSUM_NBYTES, world_size)
    return check + announce + steps * CommStats.all_gather_bytes(HEADER_BYTES + payload_nbytes, world_size)


def test_two_rank_examples_communicate_through_distro_opt_only(two_rank_example):
    name, ranks = two_rank_example
    (first,) = ranks[0]["optimizers"]
    steps = len(first["grads"])
    assert steps >= 4 and first["comm"] == "TorchDistributedBackend" and first["world_size"] == 2
    for rank in ranks:
        (opt,) = rank["optimizers"]
        assert opt["checks"] == 1 and opt["collectives"] == steps + 1
        assert opt["sent"] == opt["received"] == torch_backend_bytes(opt["payload_nbytes"], steps, 2)
        dense = steps * CommStats.ring_all_reduce_bytes(4 * opt["n_params"], 2)  # what DDP would send
        assert rank["wchar"] < dense / 10, (name, rank["wchar"], dense)
        assert rank["warnings"] == []


def test_two_rank_examples_never_all_reduce_gradients_and_end_with_identical_replicas(two_rank_example):
    _, ranks = two_rank_example
    grads = [rank["optimizers"][0]["grads"] for rank in ranks]
    assert all(a != b for a, b in zip(*grads))  # each rank's own gradient at every step
    params = [rank["optimizers"][0]["params"] for rank in ranks]
    assert all(torch.equal(a, b) for a, b in zip(*params))
    assert not all(torch.equal(p, q) for p, q in zip(params[0], ranks[0]["optimizers"][0]["start"]))


def test_fsdp2_example_keeps_the_replicas_of_each_shard_identical(tmp_path_factory):
    ranks = _launch_example("fsdp2", 4, tmp_path_factory)
    by_shard = {}
    for rank in ranks:
        (opt,) = rank["optimizers"]
        assert opt["world_size"] == 2 and opt["checks"] == 1  # the replicate group of the 2 x 2 mesh
        assert opt["sent"] == torch_backend_bytes(opt["payload_nbytes"], len(opt["grads"]), 2)
        by_shard.setdefault(rank["rank"] % 2, []).append(opt)  # rank = replicate * 2 + shard
        assert rank["warnings"] == []
    for a, b in by_shard.values():
        assert all(x != y for x, y in zip(a["grads"], b["grads"]))
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def test_plain_loop_example_trains_four_in_process_workers_alike(capsys):
    scope = runpy.run_path(str(EXAMPLES / "plain_loop.py"), run_name="__main__")
    models = scope["models"]
    assert all(torch.equal(p, q) for m in models[1:] for p, q in zip(models[0].parameters(), m.parameters()))
    payload = scope["DisTrOAdamW"](models[0].parameters()).payload_nbytes
    expected = 20 * CommStats.all_gather_bytes(payload, 4) + CommStats.all_gather_bytes(CHECKSUM_NBYTES, 4)
    assert [sent for _, sent in scope["results"]] == [expected] * 4
    assert "worker 3: loss" in capsys.readouterr().out


def test_ddp_or_fsdp1_beside_distro_opt_warns_once_unless_its_all_reduce_is_off(tmp_path):
    results, codes = launch_script(DDP_SCRIPT, 2, tmp_path)
    for rank in expect_success(results, codes, tmp_path):
        phases = rank["example"]["phases"]
        assert len(phases["synced"]) == 1 and "wrapped in DistributedDataParallel" in phases["synced"][0]
        assert "model.no_sync()" in phases["synced"][0]
        assert phases["no_sync"] == [] and phases["own_group"] == []
        assert len(phases["fsdp1"]) == 1 and "wrapped in FullyShardedDataParallel" in phases["fsdp1"][0]


def accelerate_launch(flags, script, cwd, timeout_s=180):
    """``accelerate launch FLAGS SCRIPT`` as a user types it (a free port for its rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--main_process_port", str(port),
               str(script)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_PORT")}
    return subprocess.run(command, cwd=cwd, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout_s)


def test_the_docs_accelerate_command_starts_two_cpu_processes_that_exchange_payloads(tmp_path):
    done = accelerate_launch(["--multi_gpu", "--num_processes", "2"], EXAMPLES / "accelerate_loop.py", tmp_path)
    assert done.returncode == 0, done.stderr
    ranks = re.findall(r"rank (\d): loss \S+, (\d+) bytes sent", done.stdout)
    assert sorted(r for r, _ in ranks) == ["0", "1"] and all(int(b) > 0 for _, b in ranks), done.stdout
    assert "distro-opt" not in done.stderr


def test_an_accelerate_launch_that_starts_one_process_for_several_says_so(tmp_path):
    done = accelerate_launch(["--cpu", "--num_processes", "2"], EXAMPLES / "accelerate_loop.py", tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"rank (\d): loss \S+, (\d+) bytes sent", done.stdout) == [("0", "0")]  # one, alone
    notice = [line for line in done.stderr.splitlines() if "accelerate launch was asked for several" in line]
    assert len(notice) == 1 and "--multi_gpu --num_processes 2" in notice[0], done.stderr


def test_the_docs_page_shows_each_example_file_as_it_is():
    page = (EXAMPLES.parent / "integrations.md").read_text()
    shown = dict(re.findall(r"<!-- docs/examples/(\S+) -->\n```python\n(.*?)```\n", page, flags=re.S))
    assert sorted(shown) == sorted(p.name for p in EXAMPLES.glob("*.py"))
    for name, code in shown.items():
        assert code == (EXAMPLES / name).read_text(), name


def test_transformers_and_accelerate_are_imported_only_by_their_integrations():
    code = ("import sys, distro_opt, distro_opt.comm, distro_opt.integrations\n"
            "print(sorted({'transformers', 'accelerate'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_the_trainer_integration_imports_transformers_and_torchao_without_their_start_up_lines():
    code = "import sys, distro_opt.integrations.hf\nprint('torchao' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr  # the test extra's torchao
    assert done.stderr == ""


def test_quiet_torchao_drops_only_its_two_known_lines_and_only_inside_the_block(caplog):
    from distro_opt.integrations.quiet_import import quiet_torchao

    kernel = "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: no CUDA"
    enum = "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as"
    other = "Failed to load /venv/site-packages/other/_C.so: missing"
    with caplog.at_level(logging.WARNING):
        with quiet_torchao():
            logging.getLogger("torchao").warning(kernel)
            logging.getLogger("torch.utils._pytree").warning(enum)
            logging.getLogger("torchao").warning(other)
            logging.getLogger("torchao").warning("a real torchao warning")
        logging.getLogger("torch.utils._pytree").warning(enum)
    passed = [r.getMessage() for r in caplog.records]
    # (on a CUDA build of torch the kernel line is kept: a CUDA kernel that fails to load there is news)
    assert passed == ([] if torch.version.cuda is None else [kernel]) + [other, "a real torchao warning", enum]


def test_without_ddp_prepares_models_unwrapped_and_refuses_set_ups_that_reduce_gradients_themselves():
    from types import SimpleNamespace

    from distro_opt.integrations.accelerate import without_ddp

    calls = []
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name="MULTI_CPU"),
                                  prepare_model=lambda model, **kw: calls.append(kw) or model)
    without_ddp(accelerator).prepare_model("model")
    assert calls == [{"device_placement": None, "evaluation_mode": True}]  # accelerate's way to skip DDP
    for kind in ("FSDP", "DEEPSPEED"):
        with pytest.raises(ValueError, match=f"set up for {kind}"):
            without_ddp(SimpleNamespace(distributed_type=SimpleNamespace(name=kind), prepare_model=None))


# -- checkpoints: each rank's optimizer state --------------------------------------------------


@pytest.fixture(scope="module", params=["hf_trainer_resume", "accelerate_resume"])
def resume_example(request, tmp_path_factory):
    return request.param, _launch_example(request.param, 2, tmp_path_factory)


def test_a_resumed_two_rank_run_equals_the_uninterrupted_one_bit_for_bit(resume_example):
    """Each example trains 8 steps straight, then 4 steps, a checkpoint, and 4 more resumed from it
    (three optimizers per rank, in that order). Every rank's resumed steps see the gradients of the
    straight run's last 4 steps and end at its parameters, bit for bit."""
    name, ranks = resume_example
    for rank in ranks:
        straight, interrupted, resumed = rank["optimizers"]
        assert [len(o["grads"]) for o in (straight, interrupted, resumed)] == [8, 4, 4], name
        assert interrupted["grads"] == straight["grads"][:4] and resumed["grads"] == straight["grads"][4:]
        assert all(torch.equal(a, b) for a, b in zip(resumed["start"], interrupted["params"]))
        assert all(torch.equal(a, b) for a, b in zip(resumed["params"], straight["params"]))
        assert not all(torch.equal(a, b) for a, b in zip(resumed["params"], interrupted["params"]))
        assert rank["warnings"] == []
    grads = [rank["optimizers"][0]["grads"] for rank in ranks]
    assert all(a != b for a, b in zip(*grads))  # two workers with their own data: their own error feedback


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory):
    """A DisTrOTrainer and an accelerate checkpoint, each saved by 2 ranks."""
    tmp = tmp_path_factory.mktemp("two_rank_checkpoints")
    root = tmp / "saved"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DISTRO_TEST_CHECKPOINTS", str(root))
        expect_success(*launch_script(CHECKPOINTS_SCRIPT, 2, tmp), tmp)
    return root


def test_two_rank_checkpoints_hold_each_other_ranks_optimizer_state(two_rank_checkpoints):
    trainer, accelerate = two_rank_checkpoints / "trainer" / "checkpoint-2", two_rank_checkpoints / "accelerate"
    rank0, rank1 = torch.load(trainer / "optimizer.pt"), torch.load(trainer / "optimizer-rank1.pt")
    assert rank0["state"].keys() == rank1["state"].keys()
    assert not torch.equal(rank0["state"][0]["delta"], rank1["state"][0]["delta"])  # each one's error feedback
    (acc1,) = torch.load(accelerate / "optimizers-rank1.pt")
    acc0 = torch.load(accelerate / "optimizer.bin", weights_only=False)
    assert not torch.equal(acc0["state"][0]["delta"], acc1["state"][0]["delta"])


def test_a_trainer_checkpoint_of_two_ranks_is_refused_on_one(two_rank_checkpoints):
    sys.path.insert(0, str(CHECKPOINTS_SCRIPT.parent))
    from _two_rank_checkpoints import tiny_gpt2, tokens, trainer_args

    from distro_opt.integrations.hf import DisTrOTrainer

    out = two_rank_checkpoints.parent / "one_rank"
    trainer = DisTrOTrainer(model=tiny_gpt2(), args=trainer_args(str(out), 4), train_dataset=tokens())
    with pytest.raises(ValueError, match="holds the optimizer state of 2 ranks, and this run has 1"):
        trainer.train(resume_from_checkpoint=str(two_rank_checkpoints / "trainer" / "checkpoint-2"))
    assert len(trainer.optimizer.optimizer.state) == 0  # nothing was loaded into it, nothing trained
    assert not (out / "checkpoint-4").exists()


def test_an_accelerate_checkpoint_of_two_ranks_is_refused_on_one_before_anything_changes(two_rank_checkpoints):
    sys.path.insert(0, str(CHECKPOINTS_SCRIPT.parent))
    from _two_rank_checkpoints import small_model

    from accelerate import Accelerator

    from distro_opt import DisTrOAdamW
    from distro_opt.integrations.accelerate import load_state, without_ddp

    accelerator = without_ddp(Accelerator(cpu=True))
    model = small_model()
    model, opt = accelerator.prepare(model, DisTrOAdamW(model.parameters(), lr=1e-3))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="holds the optimizer state of 2 ranks, and this run has 1"):
        load_state(accelerator, str(two_rank_checkpoints / "accelerate"), opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the saved model not loaded
    assert len(opt.optimizer.state) == 0
