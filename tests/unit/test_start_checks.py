"""What the optimizer checks when training starts: which backend ``comm=None`` means (resolved at
the first step), replicas that differ (compared at the first step and after load_state_dict), and
the one-time notices (a launcher's WORLD_SIZE without a group; one worker that still compresses)."""
import warnings

import pytest
import torch
import torch.distributed as dist

from distro_opt import DeMo, DisTrOAdamW
from distro_opt.comm import InProcessBackend, SingleWorkerBackend, resolve_backend
from distro_opt.guards import CHECKSUM_NBYTES

from _models import batch, make_model, train


def distro_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if str(w.message).startswith("distro-opt")]


def test_comm_none_uses_the_group_initialized_after_construction(tmp_path):
    model = make_model()
    opt = DisTrOAdamW(model.parameters(), lr=0.01)  # as a trainer builds it: before the group
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        train(model, opt, 2)
        assert type(opt.comm).__name__ == "TorchDistributedBackend" and opt.comm.stats.steps == 2
    finally:
        dist.destroy_process_group()


def test_an_invalid_comm_is_refused_at_construction():
    with pytest.raises(TypeError, match="Invalid comm: str"):
        DisTrOAdamW(make_model().parameters(), comm="nccl")
    with pytest.raises(ValueError, match="either comm= or process_group="):
        DeMo(make_model().parameters(), comm=SingleWorkerBackend(), process_group=SingleWorkerBackend())


def test_world_size_from_a_launcher_without_a_group_warns_once(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = make_model()
    opt = DisTrOAdamW(model.parameters())
    caught = distro_warnings(lambda: train(model, opt, 3))
    launcher = [m for m in caught if "WORLD_SIZE=2" in m]
    assert len(launcher) == 1 and "init_process_group() before the optimizer's first step" in launcher[0]


@pytest.mark.parametrize("environ", [
    {},  # a plain `python script.py`
    {"WORLD_SIZE": "1", "MASTER_PORT": "29500"},  # torchrun --nproc-per-node 1
    {"ACCELERATE_USE_CPU": "True"},  # accelerate launch --num_processes 1: no rendezvous port set
    {"ACCELERATE_USE_CPU": "True", "MASTER_PORT": "29500", "WORLD_SIZE": "1"},
])
def test_a_launch_of_one_process_that_asked_for_one_gets_no_launcher_notice(environ):
    caught = distro_warnings(lambda: resolve_backend(environ=environ))
    assert caught == []


def test_one_worker_that_compresses_gets_one_notice_at_its_first_step():
    model = make_model()
    opt = DisTrOAdamW(model.parameters())
    assert distro_warnings(lambda: None) == []  # nothing at construction
    caught = distro_warnings(lambda: train(model, opt, 3))
    assert len(caught) == 1 and "runs as a single worker" in caught[0] and "torch.optim.AdamW" in caught[0]


def test_no_notice_without_compression_or_with_a_backend_the_user_chose():
    lossless = make_model()  # every coefficient of every 64 x 64 chunk, in float32
    opt = DisTrOAdamW(lossless.parameters(), compression_topk=64 * 64, compression_bits=32)
    assert distro_warnings(lambda: train(lossless, opt, 2)) == []
    chosen = make_model()
    opt = DisTrOAdamW(chosen.parameters(), comm=SingleWorkerBackend())
    assert distro_warnings(lambda: train(chosen, opt, 2)) == []


def test_per_rank_seeds_raise_the_same_error_on_every_worker_before_anything_changes():
    models = [make_model(seed=rank) for rank in range(3)]

    def worker(comm):
        model = models[comm.rank]
        opt = DisTrOAdamW(model.parameters(), comm=comm)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError) as raised:
            train(model, opt, 1, rank=comm.rank)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and len(opt.state) == 0
        return str(raised.value).replace(f"seen by rank {comm.rank}", "seen by rank -")

    messages = InProcessBackend.run(3, worker, timeout_s=60)
    assert messages[0] == messages[1] == messages[2]
    assert "the workers hold different parameters" in messages[0] and "rank 2:" in messages[0]


@pytest.mark.parametrize("cls, odd", [
    (DisTrOAdamW, {"lr": 0.02}), (DisTrOAdamW, {"betas": (0.8, 0.999)}), (DisTrOAdamW, {"weight_decay": 0.0}),
    (DisTrOAdamW, {"eps": 1e-6}), (DisTrOAdamW, {"update": "adam"}), (DisTrOAdamW, {"error_feedback": "kept"}),
    (DisTrOAdamW, {"compression_decay": 0.9}), (DisTrOAdamW, {"sync_every": 4}), (DisTrOAdamW, {"maximize": True}),
    (DeMo, {"weight_decay": 0.1}), (DeMo, {"compression_decay": 0.99}), (DeMo, {"overlap": True}),
], ids=["lr", "betas", "weight_decay", "eps", "update", "error_feedback", "decay", "sync_every", "maximize",
        "DeMo weight_decay", "DeMo decay", "DeMo overlap"])
def test_settings_that_differ_on_one_worker_raise_the_same_error_on_every_worker_before_anything_changes(cls, odd):
    """The same parameters, and one worker given another hyperparameter: all three refuse the first
    step alike. (Settings that shape the payload, top-k, chunk and bits, fail every step's exchange
    alike instead: tests/unit/test_workers.py.)"""
    models = [make_model() for _ in range(3)]

    def worker(comm):
        model = models[comm.rank]
        opt = cls(model.parameters(), comm=comm, **{"lr": 0.01, **(odd if comm.rank == 1 else {})})
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError) as raised:
            train(model, opt, 1, rank=comm.rank)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and len(opt.state) == 0
        return str(raised.value).replace(f"seen by rank {comm.rank}", "seen by rank -")

    messages = InProcessBackend.run(3, worker, timeout_s=60)
    assert messages[0] == messages[1] == messages[2]
    assert messages[0].startswith("the workers' optimizer settings differ") and "rank 2:" in messages[0]
    assert "different parameters" not in messages[0]


def test_a_learning_rate_changed_on_one_worker_before_a_load_fails_the_next_step_and_alike_passes():
    models = [make_model(), make_model()]

    def worker(comm):
        model = models[comm.rank]
        opt = DisTrOAdamW(model.parameters(), lr=0.01, comm=comm)
        train(model, opt, 2, rank=comm.rank)
        saved = opt.state_dict()
        for group in opt.param_groups:  # a scheduler's step on every worker alike: still one model
            group["lr"] = 0.005
        train(model, opt, 1, rank=comm.rank, start=2)
        opt.load_state_dict(saved)
        if comm.rank == 0:
            opt.param_groups[0]["lr"] = 1  # the int 1 against 1.0 is the same setting
        for group in opt.param_groups if comm.rank == 1 else ():
            group["lr"] = 1.0
        train(model, opt, 1, rank=comm.rank, start=3)
        opt.load_state_dict(saved)
        opt.param_groups[0]["lr"] = 0.01 * (comm.rank + 1)  # one scheduler per rank gone astray
        with pytest.raises(ValueError, match="optimizer settings differ"):
            train(model, opt, 1, rank=comm.rank, start=4)
        return opt.replica_check_stats.steps

    assert InProcessBackend.run(2, worker, timeout_s=60) == [3, 3]


def test_a_model_checkpoint_loaded_on_one_worker_only_fails_the_next_step():
    models = [make_model(), make_model()]

    def worker(comm):
        model = models[comm.rank]
        opt = DisTrOAdamW(model.parameters(), lr=0.01, comm=comm)
        train(model, opt, 2, rank=comm.rank)
        saved = opt.state_dict()
        opt.load_state_dict(saved)  # on both workers: the check passes again
        train(model, opt, 1, rank=comm.rank, start=2)
        if comm.rank == 1:
            with torch.no_grad():
                model[0].weight.add_(1.0)  # another model checkpoint, loaded on this worker alone
        opt.load_state_dict(saved)
        with pytest.raises(ValueError, match="different parameters"):
            train(model, opt, 1, rank=comm.rank, start=3)
        return opt.replica_check_stats

    for stats in InProcessBackend.run(2, worker, timeout_s=60):
        assert stats.steps == 3 and stats.bytes_sent == 3 * CHECKSUM_NBYTES  # one peer, CHECKSUM_NBYTES each


def test_local_steps_compare_the_anchor_the_workers_agree_on():
    models = [make_model(), make_model()]

    def worker(comm):
        model = models[comm.rank]
        opt = DisTrOAdamW(model.parameters(), lr=0.01, sync_every=4, comm=comm)
        train(model, opt, 6, rank=comm.rank)  # mid-interval: each worker's parameters have drifted
        opt.load_state_dict(opt.state_dict())
        train(model, opt, 2, rank=comm.rank, start=6)
        return opt.replica_check_stats.steps, [p.detach().clone() for p in model.parameters()]

    (checks0, after0), (checks1, after1) = InProcessBackend.run(2, worker, timeout_s=60)
    assert checks0 == checks1 == 2
    assert all(torch.equal(a, b) for a, b in zip(after0, after1))  # the sync at step 8 rejoined them


class _SelfAligningBackend(InProcessBackend):
    """A backend that keeps replicas in line its own way (as the hivemind backend does)."""

    compares_replicas = False


def test_a_backend_that_keeps_replicas_in_line_itself_is_not_asked_to_compare_them():
    models = [make_model(seed=rank) for rank in range(2)]

    def worker(comm):
        opt = DisTrOAdamW(models[comm.rank].parameters(), comm=comm)
        x, y = batch(0, comm.rank)
        torch.nn.functional.cross_entropy(models[comm.rank](x), y).backward()
        opt.step()
        return opt.replica_check_stats.steps, comm.stats.steps

    assert InProcessBackend.run(2, worker, timeout_s=60, backends=_SelfAligningBackend.create(2)) == [(0, 1)] * 2
