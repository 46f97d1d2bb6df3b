"""TorchDistributedBackend across real processes (Gloo on 127.0.0.1), and NCCL where a GPU exists.

Each test launches ranks of tests/_dist_worker.py as subprocesses with a wall-clock bound, kills
whatever is left on the way out, and checks the per-rank results the workers saved.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # run as a rank (the scenarios at the end): the helpers are in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ranks import HEADER_BYTES, expect_success, launch, read_logs  # noqa: E402

SELF = Path(__file__)  # a rank that also knows the scenarios at the end of this file
DESCRIPTOR_BYTES = 64  # what ranks send to agree on an all_reduce tensor's shape and dtype


def pattern(nbytes, rank, call):
    return [int(v) for v in (torch.arange(nbytes) * (rank + 3) + call * 7 + rank) % 256]


# -- the batched launches: one process group per world size serves many tests ------------------

TRAIN = ["--steps", "10", "--no-log"]
GRAD_SCALER_INF = ["--steps", "6", "--no-log", "--grad-scaler", "--inject-inf", "1:2"]
BF16 = ["--steps", "15", "--no-log", "--dtype", "bfloat16", "--autocast"]
WCHAR_NBYTES, WCHAR_CALLS = 1 << 20, 10


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt") / "run"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, checkpoint_dir):
    tmp = tmp_path_factory.mktemp("two")
    jobs = [
        ["sizes", "sizes", []],
        ["wchar", "wchar", [WCHAR_NBYTES, WCHAR_CALLS]],
        ["mismatch", "mismatch", []],
        ["train", "train", TRAIN + ["--save-dir", checkpoint_dir]],
        ["overlap", "train", TRAIN + ["--overlap"]],
        ["inf", "train", GRAD_SCALER_INF],
        ["bf16", "train", BF16],
    ]
    return expect_success(*launch(jobs, 2, tmp, timeout_s=120), tmp)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory, two_ranks, checkpoint_dir):
    tmp = tmp_path_factory.mktemp("three")
    jobs = [
        ["raw", "raw", []],
        ["wchar", "wchar", [WCHAR_NBYTES, WCHAR_CALLS]],
        ["train", "train", TRAIN],
        ["resume", "train", ["--steps", "5", "--no-log", "--resume-dir", checkpoint_dir]],
    ]
    return expect_success(*launch(jobs, 3, tmp, timeout_s=120), tmp)


def job(results, name):
    return [res[name] for res in results]


# -- raw buffers ---------------------------------------------------------------------------------


def test_all_gather_returns_every_ranks_bytes_in_rank_order(three_ranks):
    for res in job(three_ranks, "raw"):
        assert res["gather"] == [pattern(5, r, 0) for r in range(3)]


def test_start_all_gather_results_match_their_calls(three_ranks):
    for res in job(three_ranks, "raw"):
        assert res["async"] == [[pattern(5, r, c) for r in range(3)] for c in (1, 2)]


def test_all_reduce_mean_and_sum(three_ranks):
    for res in job(three_ranks, "raw"):
        assert res["mean"] == [2.0, 2.0]  # mean of 1, 2, 3 and of 0, 2, 4
        assert res["sum"] == [6.0]


def test_rank_and_world_size_come_from_the_group(three_ranks):
    assert [(res["rank"], res["world_size"]) for res in job(three_ranks, "raw")] == [(0, 3), (1, 3), (2, 3)]


def test_stats_count_payload_header_and_size_agreement(three_ranks):
    # First gather: an 8-byte size announcement, then the 5-byte payload framed with its length;
    # then two more framed gathers. Each frame goes to 2 peers.
    gathers = HEADER_BYTES + 3 * (HEADER_BYTES + 5)
    # First all-reduce: the ranks agree on its descriptor (sent to 2 peers), then reduce 2 floats
    # and the flag (12 bytes; ring: ceil(2 * 2/3 * 12) = 16). The second, of 1 float: the agreed
    # frame goes out flagged (16), the ranks agree anew, then reduce 1 float and the flag (8 bytes: 11).
    reduces = (2 * DESCRIPTOR_BYTES + 16) + (16 + 2 * DESCRIPTOR_BYTES + 11)
    for res in job(three_ranks, "raw"):
        assert res["bytes_sent"] == 2 * gathers + reduces
        assert res["steps"] == 5


def test_process_groups_are_wrapped_by_resolve_backend(three_ranks):
    for res in job(three_ranks, "raw"):
        assert res["resolved"] == ["TorchDistributedBackend", "TorchDistributedBackend"]


def test_sub_group_gathers_among_its_members_only(three_ranks):
    raw = job(three_ranks, "raw")
    assert raw[0]["sub"] == raw[1]["sub"] == [pattern(3, r, 9) for r in range(2)]
    assert raw[2]["sub"]["error_type"] == "ValueError"
    assert "not a member" in raw[2]["sub"]["error"]


# -- sizes ---------------------------------------------------------------------------------------


def test_different_sizes_at_the_first_call_raise_on_every_rank(two_ranks):
    for res in job(two_ranks, "sizes"):
        call = res["calls"][0]
        assert call["error_type"] == "ValueError"
        assert "rank 0: 10 bytes, rank 1: 11 bytes" in call["error"]


def test_one_rank_changing_size_later_raises_on_every_rank(two_ranks):
    for res in job(two_ranks, "sizes"):
        assert res["calls"][1]["ok"] == [pattern(16, r, 1) for r in range(2)]
        assert "rank 0: 16 bytes, rank 1: 17 bytes" in res["calls"][2]["error"]


def test_all_ranks_changing_size_together_is_agreed_and_delivered(two_ranks):
    for res in job(two_ranks, "sizes"):
        assert res["calls"][3]["ok"] == [pattern(20, r, 3) for r in range(2)]
        assert res["calls"][4]["ok"] == [pattern(20, r, 4) for r in range(2)]


# -- all-reduce agreement ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reduce_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reduce")
    jobs = [["reduce", "reduce_agreement", []]]
    return job(expect_success(*launch(jobs, 2, tmp, timeout_s=60, worker=SELF), tmp), "reduce")


def test_all_reduce_of_different_sizes_raises_the_same_error_on_every_rank(reduce_ranks):
    for res in reduce_ranks:
        assert res["size"]["error_type"] == "ValueError", res["size"]
        shapes = "rank 0: torch.float32 of shape (3,), rank 1: torch.float32 of shape (4,)"
        assert shapes in res["size"]["error"]


def test_all_reduce_of_different_dtypes_raises_the_same_error_on_every_rank(reduce_ranks):
    for res in reduce_ranks:
        assert res["dtype"]["error_type"] == "ValueError", res["dtype"]
        dtypes = "rank 0: torch.float32 of shape (3,), rank 1: torch.float64 of shape (3,)"
        assert dtypes in res["dtype"]["error"]


def test_all_reduce_after_a_refused_call_agrees_on_the_new_shape_and_reduces(reduce_ranks):
    for res in reduce_ranks:
        assert res["agreed"] == {"ok": [2.0, 2.0, 2.0]}
        assert res["resized"] == {"ok": [1.5] * 5}


def test_all_reduce_mean_of_an_integer_tensor_is_refused_before_anything_is_sent(reduce_ranks):
    for rank, res in enumerate(reduce_ranks):
        assert res["int_mean"]["error_type"] == "ValueError", res["int_mean"]
        assert "op='mean' of a torch.int64 tensor" in res["int_mean"]["error"]
        assert res["int_mean_left"] == [rank + 1, 10]
        assert res["int_mean_stats"] == [0, 0]


# -- bytes seen by the OS ------------------------------------------------------------------------


@pytest.mark.parametrize("world", ["two_ranks", "three_ranks"])
def test_bytes_sent_matches_the_bytes_the_process_wrote(world, request):
    # Gloo's TCP transport sends with writev(2), which the kernel counts in /proc/self/io wchar
    # (measured: wchar - bytes_sent = 288 bytes per collective and peer, Gloo's own framing, for any
    # buffer size). 1 MiB buffers x 10 collectives make that framing (0.03 %) and stray writes
    # negligible; the idle measurement shows the process writes nothing else meanwhile.
    results = request.getfixturevalue(world)
    world_size = len(results)
    for res in job(results, "wchar"):
        assert res["bytes_sent"] == WCHAR_CALLS * (world_size - 1) * (WCHAR_NBYTES + HEADER_BYTES)
        assert res["wchar"] == pytest.approx(res["bytes_sent"], rel=0.02)
        assert res["idle_wchar"] < 0.001 * res["bytes_sent"]


# -- training with DisTrOAdamW -------------------------------------------------------------------


def simulate(world_size, argv):
    """The same training in one process: InProcessBackend workers on threads."""
    from distro_opt.comm import InProcessBackend
    from distro_opt.experiments.train_ddp import TrainConfig, train

    cfg = TrainConfig.from_args([str(a) for a in argv])
    return InProcessBackend.run(world_size, lambda backend: train(cfg, backend), timeout_s=60)


def assert_bitwise_equal(params, expected):
    assert params.keys() == expected.keys()
    for name in params:
        assert params[name].dtype == expected[name].dtype, name
        got, want = params[name].flatten().view(torch.uint8), expected[name].flatten().view(torch.uint8)
        assert torch.equal(got, want), name


def assert_matches_simulation(results, argv):
    simulated = simulate(len(results), argv)
    for res, sim in zip(results, simulated):
        assert_bitwise_equal(res["params"], results[0]["params"])
        assert_bitwise_equal(res["params"], sim["params"])
        assert res["losses"] == sim["losses"]


@pytest.mark.parametrize(
    "world,name,argv",
    [
        ("two_ranks", "train", TRAIN),
        ("three_ranks", "train", TRAIN),
        ("two_ranks", "overlap", TRAIN + ["--overlap"]),
    ],
    ids=["2-ranks", "3-ranks", "2-ranks-overlap"],
)
def test_gloo_training_is_bitwise_identical_across_ranks_and_to_the_simulation(world, name, argv, request):
    results = job(request.getfixturevalue(world), name)
    assert_matches_simulation(results, argv)
    assert results[0]["eval_loss"] < results[0]["eval_loss_start"]


@pytest.mark.parametrize("case", ["size", "layout"])  # other payload size; same size, other shapes
def test_models_that_differ_fail_the_replica_check_at_the_first_step_on_every_rank(two_ranks, case):
    errors = [res[case]["error"] for res in job(two_ranks, "mismatch")]
    for res in job(two_ranks, "mismatch"):
        assert res[case]["error_type"] == "ValueError"
    assert "the workers hold different parameters" in errors[0]
    assert errors[0] == errors[1].replace("seen by rank 1", "seen by rank 0")  # every rank, alike


def test_a_learning_rate_that_differs_on_one_rank_fails_the_first_step_on_every_rank(two_ranks):
    results = job(two_ranks, "mismatch")
    assert [res["settings"]["error_type"] for res in results] == ["ValueError", "ValueError"]
    errors = [res["settings"]["error"] for res in results]
    assert errors[0].startswith("the workers' optimizer settings differ") and "different parameters" not in errors[0]
    assert errors[0] == errors[1].replace("seen by rank 1", "seen by rank 0")  # every rank, alike


def test_inf_grads_on_one_rank_with_grad_scaler_keep_every_rank_in_step(two_ranks):
    results = job(two_ranks, "inf")
    assert results[1]["losses"][2] == float("inf") and results[0]["losses"][2] < 1
    assert_matches_simulation(results, GRAD_SCALER_INF)
    assert all(torch.isfinite(p).all() for p in results[0]["params"].values())


def test_bf16_parameters_with_autocast_train_across_two_ranks(two_ranks):
    for res in job(two_ranks, "bf16"):
        assert all(p.dtype == torch.bfloat16 for p in res["params"].values())
        assert_bitwise_equal(res["params"], job(two_ranks, "bf16")[0]["params"])
        assert res["eval_loss"] < 0.8 * res["eval_loss_start"]


def test_checkpoint_saved_by_two_ranks_resumes_on_three(three_ranks, two_ranks, checkpoint_dir):
    results = job(three_ranks, "resume")
    assert_matches_simulation(results, ["--steps", "5", "--no-log", "--resume-dir", checkpoint_dir])
    # It starts from the two ranks' final parameters, not from scratch.
    assert results[0]["eval_loss_start"] == job(two_ranks, "train")[0]["eval_loss"]


# -- faults --------------------------------------------------------------------------------------


def test_killed_rank_makes_the_other_fail_fast_with_a_clear_error(tmp_path):
    results, codes = launch([["dead", "dead_peer", [30, "killed", "gather"]]], 2, tmp_path, timeout_s=40)
    assert codes[1] == -9
    assert codes[0] == 0, read_logs(tmp_path, 2)
    res = results[0]["dead"]
    assert res["error_type"] == "CollectiveError"
    assert "rank 0 of 2: all_gather did not complete" in res["error"]
    assert "died" in res["error"]
    assert res["elapsed_s"] < 10  # the timeout was 30 s: the dead peer was detected, not waited for


def _waited_for_hung_peer(tmp_path, collective: str) -> dict:
    """Rank 0's outcome of ``collective`` with timeout_s=2 while rank 1 hangs: a CollectiveError
    after about the timeout, not the test's 40 s."""
    results, codes = launch([["hung", "dead_peer", [2, "hung", collective]]], 2, tmp_path, timeout_s=40,
                            wait_ranks=[0])
    assert codes[0] == 0, read_logs(tmp_path, 2)
    res = results[0]["hung"]
    assert res["error_type"] == "CollectiveError"
    assert 1.5 < res["elapsed_s"] < 10
    return res


def test_hung_rank_makes_the_other_fail_after_timeout_s(tmp_path):
    assert "timeout_s=2" in _waited_for_hung_peer(tmp_path, "gather")["error"]


def test_barrier_names_the_rank_that_did_not_arrive(tmp_path):
    error = _waited_for_hung_peer(tmp_path, "barrier")["error"]
    assert "rank 0 of 2: barrier did not complete" in error
    assert "Ranks 1 failed to pass monitoredBarrier" in error


def test_barrier_without_timeout_s_is_bounded_by_the_groups_own_timeout(tmp_path):
    # timeout_s=None: "only the group's own timeout applies" (3 s here), not monitored_barrier's
    # default of 30 minutes
    results, codes = launch([["hung", "dead_peer", ["group:3", "hung", "barrier"]]], 2, tmp_path,
                            timeout_s=40, wait_ranks=[0])
    assert codes[0] == 0, read_logs(tmp_path, 2)
    res = results[0]["hung"]
    assert res["error_type"] == "CollectiveError"
    assert "Ranks 1 failed to pass monitoredBarrier in 3000 ms" in res["error"]
    assert 2.5 < res["elapsed_s"] < 10


# -- construction --------------------------------------------------------------------------------


def test_backend_without_an_initialized_group_says_how_to_fix_it():
    from distro_opt.comm.torch_backend import TorchDistributedBackend

    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchDistributedBackend()


def test_a_rendezvous_file_without_rank_names_the_missing_variable(monkeypatch, tmp_path):
    import datetime

    from distro_opt.experiments.process_group import start_process_group

    monkeypatch.setenv("DISTRO_OPT_RENDEZVOUS_FILE", str(tmp_path / "rendezvous"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="RANK not"):
        start_process_group("gloo", datetime.timedelta(seconds=5))


def test_checkpoint_is_never_overwritten(tmp_path):
    from distro_opt.comm import SingleWorkerBackend
    from distro_opt.experiments.train_ddp import TrainConfig, train

    cfg = TrainConfig(steps=1, log=False, save_dir=str(tmp_path))
    train(cfg, SingleWorkerBackend())
    saved = (tmp_path / "rank0.pt").read_bytes()
    with pytest.raises(FileExistsError):
        train(cfg, SingleWorkerBackend())
    assert (tmp_path / "rank0.pt").read_bytes() == saved


def test_resume_from_an_incomplete_checkpoint_names_the_problem(tmp_path):
    from distro_opt.comm import SingleWorkerBackend
    from distro_opt.experiments.train_ddp import TrainConfig, train

    train(TrainConfig(steps=1, log=False, save_dir=str(tmp_path)), SingleWorkerBackend())
    (tmp_path / "rank1.pt").write_bytes((tmp_path / "rank0.pt").read_bytes())  # claims world size 1
    with pytest.raises(ValueError, match="incomplete: 2 of 1 rank files"):
        train(TrainConfig(steps=1, log=False, resume_dir=str(tmp_path)), SingleWorkerBackend())


def test_resume_on_the_same_world_size_reproduces_an_uninterrupted_run(tmp_path):
    straight = simulate(2, ["--steps", "8", "--no-log"])
    simulate(2, ["--steps", "4", "--no-log", "--save-dir", tmp_path])
    resumed = simulate(2, ["--steps", "4", "--no-log", "--resume-dir", tmp_path])
    for a, b in zip(resumed, straight):
        assert_bitwise_equal(a["params"], b["params"])
        assert a["losses"] == b["losses"][4:]


def test_resume_on_fewer_ranks_warns_that_residuals_are_dropped(tmp_path):
    simulate(3, ["--steps", "3", "--no-log", "--save-dir", tmp_path])
    with pytest.warns(UserWarning, match="ranks 2..2 is dropped"):
        resumed = simulate(2, ["--steps", "3", "--no-log", "--resume-dir", tmp_path])
    assert_bitwise_equal(resumed[1]["params"], resumed[0]["params"])


# -- NCCL (needs a GPU; CI has none, so these are skipped there) --------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs CUDA GPUs; none here")


@pytest.mark.nccl
@needs_cuda
def test_nccl_gathers_and_reduces_cuda_buffers(tmp_path):
    world_size = min(2, torch.cuda.device_count())
    results = expect_success(*launch([["raw", "cuda_raw", []]], world_size, tmp_path, timeout_s=120,
                                     dist_backend="nccl"), tmp_path)
    for res in job(results, "raw"):
        assert res["devices"] == ["cuda"]
        assert res["gather"] == [pattern(5, r, 0) for r in range(world_size)]
        assert res["async"] == [pattern(7, r, 1) for r in range(world_size)]
        assert res["mean"] == [(world_size + 1) / 2] * 3


@pytest.mark.nccl
@needs_cuda
def test_nccl_training_is_identical_across_ranks_and_learns(tmp_path):
    world_size = min(2, torch.cuda.device_count())
    argv = TRAIN + ["--device", "cuda"]
    results = expect_success(*launch([["train", "train", argv]], world_size, tmp_path, timeout_s=120,
                                     dist_backend="nccl"), tmp_path)
    for res in job(results, "train"):
        assert_bitwise_equal(res["params"], results[0]["train"]["params"])
        assert res["eval_loss"] < res["eval_loss_start"]


# -- scenarios only these tests use: ``python tests/comm/test_torch_backend.py OUTDIR JOBS`` is a rank -----


def attempt(fn) -> dict:
    """What ``fn()`` returned, or which exception it raised (any type: the test names the right one)."""
    try:
        return {"ok": fn()}
    except Exception as exc:  # noqa: BLE001
        return {"error_type": type(exc).__name__, "error": str(exc)}


def scenario_reduce_agreement(rank, world_size, args):
    """all_reduce calls the ranks disagree on (each refused on every rank), then calls they agree on."""
    from distro_opt.comm.torch_backend import TorchDistributedBackend

    backend = TorchDistributedBackend(timeout_s=10)
    res = {"agreed": attempt(lambda: backend.all_reduce(torch.ones(3), "sum").tolist())}
    res["size"] = attempt(lambda: backend.all_reduce(torch.ones(3 + rank), "sum").tolist())
    dtype = torch.float64 if rank == 1 else torch.float32
    res["dtype"] = attempt(lambda: backend.all_reduce(torch.ones(3, dtype=dtype), "sum").tolist())
    res["resized"] = attempt(lambda: backend.all_reduce(torch.full((5,), float(rank + 1)), "mean").tolist())
    stats = backend.stats.bytes_sent, backend.stats.steps
    ints = torch.tensor([rank + 1, 10])
    res["int_mean"] = attempt(lambda: backend.all_reduce(ints, "mean").tolist())
    res["int_mean_left"] = ints.tolist()
    res["int_mean_stats"] = [backend.stats.bytes_sent - stats[0], backend.stats.steps - stats[1]]
    return res


if __name__ == "__main__":
    import _dist_worker

    _dist_worker.SCENARIOS["reduce_agreement"] = scenario_reduce_agreement
    _dist_worker.main()
