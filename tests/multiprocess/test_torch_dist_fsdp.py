"""DisTrOAdamW on FSDP2 (DTensor) parameters across real processes: Gloo on 127.0.0.1, a 2 x 2
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``, the model sharded with
``fully_shard`` over the shard dimension and the optimizer communicating over the replicate one.

The reference is the unsharded run: one process per replica, each on its replica's whole batch
(the sharded run splits it between the replica's two shard ranks, whose gradients FSDP2 averages).
The model's local shards have rows in multiples of 64, so every shard is cut into the chunks the
unsharded parameter has, and the two runs compress the same coefficients.
"""
from __future__ import annotations

import pytest
import torch

from distro_opt.comm import CommStats
from distro_opt.guards import CHECKSUM_NBYTES
from distro_opt.wire import PayloadLayout, param_spec
from _ranks import HEADER_BYTES, expect_success, launch

STEPS = 6


@pytest.fixture(scope="module", params=[1, 2], ids=["per-step", "local-steps"])
def runs(request, tmp_path_factory):
    """(the 4 sharded ranks' results, the 2 unsharded replicas' results) for sync_every 1 or 2."""
    sync_every = request.param
    sharded_dir, plain_dir = tmp_path_factory.mktemp("sharded"), tmp_path_factory.mktemp("plain")
    sharded, codes = launch([["run", "fsdp_hybrid", [STEPS, sync_every]]], 4, sharded_dir, timeout_s=180)
    expect_success(sharded, codes, sharded_dir)
    plain, codes = launch([["run", "plain_replicas", [STEPS, sync_every]]], 2, plain_dir, timeout_s=120)
    expect_success(plain, codes, plain_dir)
    return [r["run"] for r in sharded], [r["run"] for r in plain]


def test_sharded_training_takes_the_unsharded_runs_steps(runs):
    sharded, plain = runs
    for rank in sharded:
        for got, want in zip(rank["full"], plain[0]["full"]):
            # float rounding of the split batch may flip the sign of a near-zero direction: a tie
            differ = (got - want).abs() > 1e-5
            assert differ.float().mean() <= 0.005, f"{int(differ.sum())} of {differ.numel()} entries differ"
    assert all(torch.equal(a, b) for a, b in zip(plain[0]["full"], plain[1]["full"]))


def test_replicas_of_one_shard_stay_bitwise_identical(runs):
    sharded, _ = runs
    by_shard = {}
    for rank in sharded:
        by_shard.setdefault(rank["shard"], []).append(rank["local"])
    assert sorted(by_shard) == [0, 1]
    for replicas in by_shard.values():
        assert len(replicas) == 2
        assert all(torch.equal(a, b) for a, b in zip(*replicas))


def test_bytes_per_step_are_the_local_shards_payload(runs):
    sharded, plain = runs
    sync_every = STEPS // (sharded[0]["steps"] - sharded[0]["checks"])
    for rank in sharded:
        layout = PayloadLayout([param_spec(shape, 8, 64, 1) for shape in rank["local_shapes"]])
        assert rank["payload_nbytes"] == layout.nbytes < plain[0]["payload_nbytes"]
        assert rank["world_size"] == 2  # the replicate group: the shard ranks never exchange payloads
        syncs = STEPS // sync_every
        framed = CommStats.all_gather_bytes(HEADER_BYTES + layout.nbytes, 2)
        # the replica check at the first step: a size announcement, then the framed checksum
        assert rank["checks"] == 1
        assert rank["check_sent"] == HEADER_BYTES + CommStats.all_gather_bytes(HEADER_BYTES + CHECKSUM_NBYTES, 2)
        # then the payload's size announcement (in the checksum's slot) and the frames
        announce = CommStats.all_gather_bytes(HEADER_BYTES + CHECKSUM_NBYTES, 2)
        assert rank["bytes_sent"] == rank["check_sent"] + announce + syncs * framed


def test_state_of_sharded_parameters_is_kept_as_dtensors(runs):
    sharded, _ = runs
    assert all("DTensor" in rank["state_types"] for rank in sharded)


@pytest.mark.parametrize("sync_every", [1, 2], ids=["per-step", "local-steps"])
def test_a_sharded_run_resumes_bit_identically_from_each_ranks_state_dict(tmp_path, sync_every):
    results, codes = launch([["resume", "fsdp_resume", [0, sync_every, str(tmp_path)]]], 4, tmp_path, timeout_s=180)
    for rank in expect_success(results, codes, tmp_path):
        res = rank["resume"]
        assert res["delta_types"] == ["DTensor"]
        assert all(torch.equal(a, b) for a, b in zip(res["continued"], res["resumed"]))


@pytest.mark.parametrize("sync_every", [1, 2], ids=["per-step", "local-steps"])
def test_a_sharded_run_resumes_bit_identically_through_torch_distributed_checkpoint(tmp_path, sync_every):
    """DCP keeps one copy of a tensor that every replica holds; each replica's own momentum (and,
    with local steps, its inner optimizer's moments and the step count) must come back to it."""
    saved_at = 3 if sync_every == 1 else 2 * sync_every  # with local steps: right after a sync
    results, codes = launch([["dcp", "fsdp_dcp", [0, sync_every, str(tmp_path), saved_at]]], 4, tmp_path, timeout_s=180)
    for rank in expect_success(results, codes, tmp_path):
        res = rank["dcp"]
        assert all(torch.equal(a, b) for a, b in zip(res["continued"], res["resumed"]))


def test_uneven_shards_train_over_the_replicate_group_and_are_refused_over_the_shard_group(tmp_path):
    """Shards of 65 and 64 rows: the ranks of one replicate group hold the same shard and agree on
    the layout; a group whose ranks hold different shards fails at the first step on every rank,
    at the replica check (the ranks do not hold the same parameters), never with a wrong update."""
    (tmp_path / "a").mkdir()
    results, codes = launch([["replicate", "fsdp_uneven", ["replicate"]]], 4, tmp_path / "a", timeout_s=120)
    expect_success(results, codes, tmp_path / "a")
    assert sorted({tuple(r["replicate"]["ok"][0]) for r in results}) == [(64, 128), (65, 128)]
    (tmp_path / "b").mkdir()
    results, codes = launch([["shard", "fsdp_uneven", ["shard"]]], 4, tmp_path / "b", timeout_s=120)
    for rank in expect_success(results, codes, tmp_path / "b"):
        assert rank["shard"]["error_type"] == "ValueError"
        assert rank["shard"]["error"].startswith("the workers hold different parameters")
