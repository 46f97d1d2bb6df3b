"""The contributor-agreement rule and the safe state format of the hivemind backend (no network)."""

import math
import random

import pytest
import torch

pytest.importorskip("hivemind")

from distro_opt.comm import hivemind_wire as wire  # noqa: E402
from distro_opt.comm.hivemind_membership import majority, replica_choice  # noqa: E402
from distro_opt.comm.hivemind_state import StateFormatError, dump_state, load_state  # noqa: E402


def votes_seen_by(me, held):
    """The votes ``me`` receives: those of the peers whose payload it holds (their digest sets)."""
    return {q: set(held[q].values()) for q in held if q != me and q in held[me]}


def agree_untrusted(held, votes):
    """``agree`` where strangers may contribute, as the backend's round runs it."""
    return wire.agree(held, votes, wire.refused(held, votes))


def test_agree_keeps_payloads_every_voter_holds():
    held = {"a": "1", "b": "2", "c": "3"}
    votes = {"b": {"1", "2", "3"}, "c": {"1", "2"}}
    assert wire.agree(held, votes) == ["a", "b"]


def test_agree_is_the_same_on_every_peer_when_all_votes_arrive():
    held = {"a": {"a": "1", "b": "2"}, "b": {"a": "1", "b": "2"}, "c": {"a": "1", "b": "2", "c": "3"}}
    results = {me: wire.agree(held[me], votes_seen_by(me, held)) for me in held}
    assert results == {"a": ["a", "b"], "b": ["a", "b"], "c": ["a", "b"]}


def test_digests_a_vote_holds_that_this_peer_does_not_add_nothing():
    held = {"a": "1", "b": "2"}
    assert wire.agree(held, {"b": {"1", "2", "made-up"}}) == ["a", "b"]


def test_agree_drops_a_sender_that_sent_different_payloads_to_different_peers():
    held = {"a": "1", "b": "2", "r": "x1"}
    votes = {"r": {"1", "2", "x1"}, "b": {"1", "2", "x2"}}
    assert wire.agree(held, votes) == ["a", "b"]


def test_agree_ignores_votes_of_peers_whose_payload_is_not_held():
    held = {"a": "1", "b": "2"}
    assert wire.agree(held, {"stranger": set()}) == ["a", "b"]


def test_with_untrusted_peers_a_vote_for_its_own_payload_alone_is_refused():
    held = {"a": "1", "b": "2", "c": "3", "r": "4"}
    votes = {"b": {"1", "2", "3", "4"}, "c": {"1", "2", "3", "4"}, "r": {"4"}}
    assert wire.agree(held, votes) == ["r"]  # a trusted run takes every vote at its word
    assert wire.refused(held, votes) == {"r"}
    assert agree_untrusted(held, votes) == ["a", "b", "c"]


def test_with_untrusted_peers_a_vote_lacking_half_of_the_others_still_drops_them():
    held = {"a": "1", "b": "2", "c": "3", "d": "4", "r": "5"}
    everything = set(held.values())
    votes = {"b": everything, "c": everything, "d": everything, "r": {"3", "4", "5"}}  # lacks 2 of 4
    assert agree_untrusted(held, votes) == ["c", "d", "r"]
    votes["r"] = {"4", "5"}  # lacks 3 of 4
    assert agree_untrusted(held, votes) == ["a", "b", "c", "d"]


def test_with_untrusted_peers_a_payload_one_peer_missed_is_dropped_everywhere_as_before():
    everything = {"a": "1", "b": "2", "c": "3"}
    held = {"a": everything, "b": everything, "c": {"a": "1", "c": "3"}}  # b's payload was late at c
    results = {me: agree_untrusted(held[me], votes_seen_by(me, held)) for me in held}
    assert results == dict.fromkeys(held, ["a", "c"])


def test_with_untrusted_peers_two_peers_keep_the_plain_intersection():
    held = {"a": "1", "r": "2"}
    assert agree_untrusted(held, {"r": {"2"}}) == ["r"]


@pytest.mark.parametrize("num_honest", [2, 3, 4, 5, 8])
def test_one_rogue_vote_keeps_at_least_half_of_the_honest_payloads_and_splits_no_one(num_honest):
    # every payload reaches every peer; the rogue votes any subset, made-up digests included, and
    # the same vote to every honest peer
    rng = random.Random(num_honest)
    honest = [f"h{i}" for i in range(num_honest)]
    held = {p: f"d-{p}" for p in honest + ["r"]}
    digests = list(held.values()) + ["made-up-1", "made-up-2"]
    for _ in range(50):
        rogue_vote = set(rng.sample(digests, rng.randrange(len(digests) + 1)))
        results = set()
        for me in honest:
            votes = {q: set(held.values()) for q in honest if q != me} | {"r": rogue_vote}
            results.add(tuple(agree_untrusted(held, votes)))
        assert len(results) == 1
        kept = set(results.pop()) & set(honest)
        assert 2 * len(kept) >= num_honest, (rogue_vote, kept)


def test_vote_roundtrip_gives_the_digests():
    digests = [wire.digest("a", b"x"), wire.digest("b", b"x")]
    assert wire.decode_vote(wire.encode_vote(4, digests), 4) == frozenset(digests)
    assert digests[0] != digests[1]  # equal bytes from two senders are two payloads


def test_decode_vote_rejects_a_vote_for_another_step():
    with pytest.raises(wire.WireError, match="step 3"):
        wire.decode_vote(wire.encode_vote(4, [wire.digest("a", b"")]), 3)


def test_decode_vote_rejects_partial_digests():
    with pytest.raises(wire.WireError, match="whole digests"):
        wire.decode_vote(wire.encode_vote(1, [wire.digest("a", b"")]) + b"\x00", 1)


def test_majority_needs_more_than_half():
    assert majority({"a": "x", "b": "x", "c": "y"}) == ("x", ["a", "b"])
    assert majority({"a": "x", "b": "y"}) == (None, [])


@pytest.mark.parametrize(
    "reports, run_size, chosen",
    [
        ({"a": "x", "b": "x", "c": "y"}, 3, ("x", ["a", "b"])),  # a majority
        ({"a": "y", "b": "y", "c": "x", "d": "z"}, 4, ("y", ["a", "b"])),  # the most reported, not half
        ({"a": "y", "b": "y", "c": "x", "d": "x"}, 4, ("x", ["c", "d"])),  # 2-2: the lower
        ({"a": "y", "b": "x"}, 2, ("x", ["b"])),  # a run of two that split
        ({"a": "y", "b": "x"}, 3, (None, [])),  # a third peer's report is missing: no guess
        ({"a": "y", "b": "x", "c": "z"}, 3, (None, [])),  # every report differs
        ({"a": "x"}, 1, (None, [])),  # nothing to compare
        ({"a": "x", "b": "x"}, 2, ("x", ["a", "b"])),
    ],
)
def test_replica_choice_picks_one_checksum_for_every_split_it_can_tell_apart(reports, run_size, chosen):
    assert replica_choice(reports, run_size) == chosen
    # whoever reads the reports, in any order, picks the same
    assert replica_choice(dict(reversed(list(reports.items()))), run_size) == chosen


def test_state_roundtrip_keeps_tensors_types_and_int_keys():
    tree = {
        "model": {
            "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.tensor([1, 2], dtype=torch.bfloat16),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "delta": torch.ones(4)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "nan": math.nan}],
        },
        "empty": torch.empty(0, 5),
    }
    out = load_state(dump_state(tree))
    assert torch.equal(out["model"]["w"], tree["model"]["w"])
    assert out["model"]["b"].dtype == torch.bfloat16 and torch.equal(out["model"]["b"], tree["model"]["b"])
    assert list(out["optimizer"]["state"]) == [0]
    assert torch.equal(out["optimizer"]["state"][0]["delta"], torch.ones(4))
    assert out["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.99]
    assert math.isnan(out["optimizer"]["param_groups"][0]["nan"])
    assert out["empty"].shape == (0, 5)


def test_state_load_refuses_a_pickle():
    import pickle

    with pytest.raises(StateFormatError, match="magic"):
        load_state(pickle.dumps({"w": torch.ones(2)}))


def test_state_load_refuses_a_tensor_past_the_end():
    blob = dump_state({"w": torch.ones(100)})
    with pytest.raises(StateFormatError, match="cover 400 bytes of a 392-byte body"):
        load_state(blob[:-8])


def test_state_load_refuses_a_size_that_does_not_match_the_shape():
    blob = dump_state({"w": torch.ones(4)})
    forged = blob.replace(b'"shape": [4]', b'"shape": [9]')
    with pytest.raises(StateFormatError, match="inconsistent"):
        load_state(forged)


def test_state_load_refuses_an_unknown_dtype():
    blob = dump_state({"w": torch.ones(4)})
    with pytest.raises(StateFormatError, match="dtype"):
        load_state(blob.replace(b'"float32"', b'"object0"'))


def test_a_peer_listening_on_loopback_only_does_not_map_ports_on_the_local_network():
    from distro_opt.comm.hivemind_backend import dht_options

    assert dht_options(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"], None) == {"nat_port_map": False}
    assert dht_options(["/ip4/127.0.0.1/tcp/0"], {"nat_port_map": True}) == {"nat_port_map": True}
    assert dht_options(["/ip4/0.0.0.0/tcp/0"], None) == {}
    assert dht_options(["/ip4/127.0.0.1/tcp/0", "/ip4/192.0.2.7/udp/0/quic"], {"use_auto_relay": True}) == {
        "use_auto_relay": True
    }
    assert dht_options(["/dns4/example.org/tcp/31337"], None) == {}
