"""integrations.rank_states: each rank's optimizer state beside a tool's checkpoint, and the
checkpoints a world cannot resume exactly, refused alike on every rank (the files as the ranks
write them; the multi-process runs are in tests/multiprocess/test_integrations.py)."""
import pytest
import torch

from distro_opt.integrations import rank_states


def saved_by(directory, world_size, ranks=None):
    for rank in range(world_size) if ranks is None else ranks:
        rank_states.save(directory, {"rank": torch.tensor(rank)}, rank, world_size, "optimizer")


def test_each_rank_but_rank_0_keeps_its_own_file_and_loads_it_back(tmp_path):
    saved_by(tmp_path, 3)
    rank_states.check(tmp_path, 3, "optimizer", "optimizer.pt")
    assert rank_states.load(tmp_path, 0, "optimizer") is None  # rank 0's state is the tool's file
    assert [int(rank_states.load(tmp_path, r, "optimizer")["rank"]) for r in (1, 2)] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        rank_states.MANIFEST, "optimizer-rank1.pt", "optimizer-rank2.pt"]  # no partial files left


@pytest.mark.parametrize("saved, resumed, ranks, match", [
    (2, 3, None, "holds the optimizer state of 2 ranks, and this run has 3"),
    (2, 1, None, "holds the optimizer state of 2 ranks, and this run has 1"),
    (3, 3, [0, 1], r"lacks the optimizer state of rank\(s\) 2 \(optimizer-rank2.pt\)"),
    (None, 2, [], "has no per-rank optimizer state .*optimizer.pt holds rank 0's alone"),
], ids=["more ranks", "fewer ranks", "a rank's file missing", "a tool's checkpoint alone"])
def test_a_checkpoint_this_world_cannot_resume_exactly_is_refused(tmp_path, saved, resumed, ranks, match):
    if saved is not None:
        saved_by(tmp_path, saved, ranks)
    with pytest.raises(ValueError, match=match):
        rank_states.check(tmp_path, resumed, "optimizer", "optimizer.pt")


def test_one_rank_resumes_a_tools_checkpoint_as_it_is(tmp_path):
    rank_states.check(tmp_path, 1, "optimizer", "optimizer.pt")  # the tool's file is the whole state
