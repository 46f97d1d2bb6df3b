"""HivemindBackend against strangers: honest peers and one rogue, in this process, all on 127.0.0.1.

Each test is one attack, named after what the honest peers must still do. The rogue is a real
backend whose parts are bent (its votes, its DHT records, its streams), so that everything it sends
is well-formed and only its content lies.
"""

import asyncio
import json
import struct
import threading
import time

import pytest
import torch

hivemind = pytest.importorskip("hivemind")

from hivemind.p2p import PeerID  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

from distro_opt.comm import hivemind_catchup, hivemind_state, hivemind_wire as wire  # noqa: E402
from distro_opt.comm.hivemind_backend import HivemindBackendError  # noqa: E402
from distro_opt.comm.hivemind_membership import FAILED  # noqa: E402
from distro_opt.comm.hivemind_round import Round  # noqa: E402
from distro_opt.comm.hivemind_state import StateFormatError, dump_state, load_state  # noqa: E402

import _hm_local as local  # noqa: E402

group, gather, filled, firsts = local.group, local.gather, local.filled, local.firsts
pytestmark = pytest.mark.timeout(90)
dhts = local.dhts_fixture(4)
MADE_UP = b"\x13" * wire.DIGEST_NBYTES
INVALID = 66  # the first byte of a payload the tests' validator refuses
INVENTED = "QmXLZSLDpgE6C2WEGEXBQ4nGmDFqpKWwm3wrXNWGWPtu2z"  # a well-formed peer id nobody runs


def valid(buf) -> bool:
    return int(buf[0]) != INVALID


def bend_votes(rogue, change):
    """Make ``rogue`` send ``change(round, vote)`` instead of each (non-empty) vote it would send."""

    class BentVoteRound(Round):
        @property
        def my_vote(self):
            return self._vote

        @my_vote.setter
        def my_vote(self, vote):
            self._vote = change(self, vote) if vote else vote

    book = rogue._book

    def round_(step):
        if step not in book.rounds:
            book.rounds[step] = BentVoteRound(step)
        return book.rounds[step]

    book.round = round_


def forge_votes_and_log(rogue, log_entries):
    """Make ``rogue`` add a made-up digest to every vote and log ``log_entries(step)`` as the
    (peer, payload) pairs it applied: a voter that claims to hold a payload nobody else has."""
    bend_votes(rogue, lambda r, vote: vote + MADE_UP)
    book, finish = rogue._book, rogue._book.finish

    def finish_(r, *result):
        finish(r, *result)
        if hasattr(book, "log"):  # what the rogue serves to a peer that asks for its round log
            book.log[r.step] = log_entries(r.step)

    book.finish = finish_


def contributions(backend, result) -> dict:
    return dict(zip(backend.last_contributors, firsts(result)))


def test_a_made_up_digest_in_a_vote_never_puts_the_rogues_bytes_under_honest_names(dhts):
    with group(dhts, n=4) as bs:
        honest, rogue = bs[:3], bs[3]
        forge_votes_and_log(rogue, lambda step: [(h.peer_id, bytes(filled(9))) for h in honest])
        for _ in range(2):
            results, _ = gather([(b, filled(9 if b is rogue else 1 + i)) for i, b in enumerate(bs)])
            expected = {h.peer_id: 1 + i for i, h in enumerate(honest)} | {rogue.peer_id: 9}
            assert [contributions(h, r) for h, r in zip(honest, results)] == [expected] * 3


def vote_only_for_itself(rogue):
    """Make ``rogue`` vote that it holds its own payload only: a veto of every other payload."""
    bend_votes(rogue, lambda r, vote: wire.encode_vote(r.step, [wire.digest(rogue.peer_id, r.own)]))


def test_a_rogue_voting_for_its_own_payload_alone_is_refused_where_strangers_may_contribute(dhts):
    # untrusted_fraction 0.25, as the public peer program runs: the rogue's vote, and its payload
    # with it, are refused (a trusted run, fraction 0, takes the vote at its word: the known veto)
    with group(dhts, n=4, options=dict.fromkeys(range(3), dict(untrusted_fraction=0.25))) as bs:
        honest, rogue = bs[:3], bs[3]
        vote_only_for_itself(rogue)
        for _ in range(2):
            results, _ = gather([(b, filled(9 if b is rogue else 1 + i)) for i, b in enumerate(bs)])
            expected = {h.peer_id: 1 + i for i, h in enumerate(honest)}
            assert [contributions(h, r) for h, r in zip(honest, results)] == [expected] * 3
            assert not any(h.out_of_sync for h in honest)


def test_a_relayed_payload_under_an_invented_id_never_reaches_the_optimizer(dhts):
    invented = INVENTED
    with group(dhts, n=4) as bs:
        honest, rogue = bs[:3], bs[3]
        for b in bs:
            b.payload_validator = valid
        forge_votes_and_log(rogue, lambda step: [(invented, bytes(filled(INVALID)))])
        results, _ = gather([(b, filled(1 + i)) for i, b in enumerate(bs)])
        for h, result in zip(honest, results):
            assert invented not in h.last_contributors
            assert sorted(firsts(result)) == [1, 2, 3, 4] and all(valid(p) for p in result)


def open_stream(sender, receiver, name):
    return sender._link.p2p.call_binary_stream_handler(
        PeerID.from_base58(receiver.peer_id), f"distro/{receiver.run_id}/{name}"
    )


def test_a_stranger_to_a_private_run_downloads_no_state(dhts):
    with group(dhts, n=3, wait=False) as (a, b, stranger):
        a.allow_peers = b.allow_peers = {a.peer_id, b.peer_id}
        a.state_provider = lambda: {"w": torch.ones(3)}
        local.wait_all_visible([a, b, stranger])
        with pytest.raises(HivemindBackendError, match="served a state"):
            stranger.load_state_from_peers(prefer=[a.peer_id])
        assert torch.equal(b.load_state_from_peers(prefer=[a.peer_id])["w"], torch.ones(3))


def test_a_stranger_to_a_private_run_reads_no_payload_of_a_past_round(dhts):
    with group(dhts, n=3, wait=False) as (a, b, stranger):
        a.allow_peers = b.allow_peers = {a.peer_id, b.peer_id}
        local.wait_all_visible([a, b, stranger])
        gather([(a, filled(7)), (b, filled(8))])

        async def ask_for_the_log_of_step_0():
            try:
                _, reader, writer = await open_stream(stranger, a, "log")
            except Exception:  # noqa: BLE001 - no handler serves it
                return b""
            writer.write(b"DHL1" + struct.pack(">Q", 0))
            try:
                return await asyncio.wait_for(reader.read(1 << 16), 5)
            finally:
                writer.close()

        received = stranger._link.call(ask_for_the_log_of_step_0(), 10)
        assert bytes(filled(7)) not in received and bytes(filled(8)) not in received


def test_a_private_run_ignores_the_heartbeats_and_checksums_of_a_stranger(dhts):
    with group(dhts, n=3, wait=False) as (a, b, stranger):
        a.allow_peers = b.allow_peers = {a.peer_id, b.peer_id}
        local.wait_all_visible([a, b, stranger])
        stranger.membership.step = 10_000  # a far more advanced, in-sync peer: the best state server
        stranger.membership.beat()
        stranger.publish_checksum(5, "made-up")
        b.publish_checksum(5, "honest")
        deadline = time.monotonic() + 20

        def raw(key):  # what any peer of the DHT reads under a key, allow lists aside
            records = a.membership._signed(key)
            return {} if records is FAILED else records

        while not (
            stranger.peer_id in raw(a.membership.key) and stranger.peer_id in raw(f"{a.run_id}.checksum.5")
        ):
            assert time.monotonic() < deadline, "the stranger's records never reached the DHT"
            time.sleep(0.1)
        a.membership.refresh()
        assert set(a.membership.view()) == {b.peer_id}
        assert a.wait_for_peers(2, 0.5) == 1  # the stranger is not counted as a peer of the run
        assert a.membership.checksums(5) == {b.peer_id: "honest"}
        assert a.compare_checksum(5, "honest") is None
        assert a.membership.state_servers(None, lambda p: True) == [b.peer_id]
        # a peer of the run that leaves is seen leaving; a stranger's departure is not seen at all
        stranger.membership.leave()
        b.membership.leave()

        def left(peer):
            record = raw(a.membership.key).get(peer)
            return record is not None and json.loads(record[0])["state"] == "left"

        while not (left(b.peer_id) and left(stranger.peer_id)):
            assert time.monotonic() < deadline, "the leaves never reached the DHT"
            time.sleep(0.1)
        a.membership.refresh()
        assert a.membership.has_left(b.peer_id) and not a.membership.has_left(stranger.peer_id)
        assert a.membership.view() == {}


def forged_signature_value(body: bytes) -> list:
    """A value in the signed format, signed by a key that is not the named peer's."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return [body, public, key.sign(body, padding.PKCS1v15(), hashes.SHA256())]


def forge_record(rogue, key, peer, value, body):
    """Store ``value`` for ``peer`` under ``key`` from the rogue's DHT, as an unsigned record (the
    peer id as subkey) and as a badly signed one, both lasting far longer than any heartbeat."""
    expiration = get_dht_time() + 600
    for subkey, stored in ((peer, value), (f"signed-by:{peer}", forged_signature_value(body))):
        rogue.dht.store(key, stored, expiration, subkey=subkey)


def test_a_forged_leave_does_not_remove_a_peer_from_the_view(dhts):
    with group(dhts, n=3) as (a, b, rogue):
        left = {"state": "left", "client": False, "step": 0}
        forge_record(rogue, f"{a.run_id}.peers", a.peer_id, left, json.dumps(left).encode())
        b.membership.refresh()
        assert a.peer_id in b.membership.view()
        results, _ = gather([(a, filled(1)), (b, filled(2)), (rogue, filled(3))])
        assert [sorted(firsts(r)) for r in results] == [[1, 2, 3]] * 3


def test_forged_checksums_make_no_majority(dhts):
    with group(dhts, n=3) as (a, b, rogue):
        a.publish_checksum(5, "good")
        b.publish_checksum(5, "good")
        key = f"{a.run_id}.checksum.5"
        for peer in (a.peer_id, b.peer_id, "QmInvented1", "QmInvented2", "QmInvented3"):
            forge_record(rogue, key, peer, "evil", b"evil")
        assert a.compare_checksum(5, "good") is None
        assert b.compare_checksum(5, "good") is None


class FailingGets:
    """A DHT whose lookups fail (its stores still work): what a DHT that lost its neighbours does."""

    def __init__(self, dht):
        self.dht = dht

    def store(self, *args, **kwargs):
        return self.dht.store(*args, **kwargs)

    def get(self, *args, **kwargs):
        raise TimeoutError("no DHT node answered")


def test_a_failed_lookup_keeps_the_last_view(dhts):
    with group(dhts, n=2) as (a, b):
        b.membership.refresh()
        assert a.peer_id in b.membership.view()
        b.membership.dht = FailingGets(b.membership.dht)
        try:
            b.membership.refresh()
            assert a.peer_id in b.membership.view()
        finally:
            b.membership.dht = b.membership.dht.dht


def test_a_state_blob_whose_tensors_overlap_is_refused_before_anything_is_allocated(monkeypatch):
    made = []
    monkeypatch.setattr(hivemind_state.torch, "frombuffer", lambda *a, **k: made.append(1))
    body = bytes(1 << 16)
    table = [{"dtype": "uint8", "shape": [1 << 16], "offset": 0, "nbytes": 1 << 16}] * 64
    tree = {"__list__": [{"__tensor__": i} for i in range(64)]}
    header = json.dumps({"tree": tree, "tensors": table}).encode()
    blob = hivemind_state.MAGIC + struct.pack(">I", len(header)) + header + body
    with pytest.raises(StateFormatError, match="does not start where"):
        load_state(blob)  # 64 KiB received would be 4 MiB of tensors
    assert made == []


def test_a_state_without_a_state_entry_is_refused_and_leaves_the_step_alone(dhts):
    with group(dhts, n=2) as (a, rogue):
        rogue.state_provider = dict
        rogue._catchup._snapshot = lambda step=None: dump_state({"step": 50})
        gather([(a, filled(1)), (rogue, filled(2))])
        with pytest.raises(HivemindBackendError, match="served a state"):
            a.load_state_from_peers(prefer=[rogue.peer_id])
        assert a.step == 1


def test_a_rogues_late_answer_puts_no_honest_peer_out_of_sync(dhts):
    # the rogue answers LATE to every push and sends nothing: a lone LATE proves nothing, so the
    # honest peers go on without its payload instead of abstaining and reloading state (from it)
    with group(dhts, n=4) as (a, b, c, rogue):
        rogue._book.is_late = lambda step: True
        results, _ = gather([(a, filled(1)), (b, filled(2)), (c, filled(3))])
        assert [sorted(firsts(r)) for r in results] == [[1, 2, 3]] * 3
        assert not (a.out_of_sync or b.out_of_sync or c.out_of_sync)


def _poisoned_run(dhts, rogue_claims_honest_digest: bool):
    """Two honest servers and a rogue after one step; the rogue serves a poisoned state (and, if
    asked, describes it with the honest state's digest). Yields (a, b, joiner, rogue)."""
    honest = {"w": torch.ones(3)}
    with group(dhts, n=4) as (a, b, joiner, rogue):
        a.state_provider = b.state_provider = lambda: honest
        rogue.state_provider = lambda: {"w": torch.full((3,), 123.0)}
        if rogue_claims_honest_digest:
            rogue.state_digest = lambda state: hivemind_catchup.whole_state_digest(honest)
        rogue.membership.in_sync = lambda: True  # what it says of itself ranks it first
        gather([(a, filled(1)), (b, filled(2)), (joiner, filled(3)), (rogue, filled(4))])
        yield a, b, joiner, rogue


@pytest.mark.parametrize("lies", [False, True], ids=["own-digest", "honest-digest"])
def test_a_download_takes_the_state_the_majority_vouches_for_never_the_rogues(dhts, lies):
    runs = _poisoned_run(dhts, rogue_claims_honest_digest=lies)
    a, b, joiner, rogue = next(runs)
    try:
        state = joiner.load_state_from_peers(prefer=[rogue.peer_id, a.peer_id, b.peer_id])
        assert torch.equal(state["w"], torch.ones(3)) and joiner.step == 1
    finally:
        runs.close()


def test_with_no_majority_a_download_loads_nothing(dhts):
    # one honest server against one rogue: no state has more than half of the answers
    runs = _poisoned_run(dhts, rogue_claims_honest_digest=False)
    a, b, joiner, rogue = next(runs)
    try:
        joiner.out_of_sync = True
        with pytest.raises(HivemindBackendError, match="no state had a majority"):
            joiner.load_state_from_peers(prefer=[rogue.peer_id, a.peer_id])
        assert joiner.step == 1 and joiner.out_of_sync
    finally:
        runs.close()


def blocking_provider(release: threading.Event, calls: list):
    def provide():
        calls.append(1)
        release.wait(10)
        return {"w": torch.ones(2)}

    return provide


async def ask_for_state(stranger, server, count: int, answered: list):
    async def one():
        _, reader, writer = await open_stream(stranger, server, "state")
        try:
            writer.write(wire.STATE_MAGIC)
            answered.append((await asyncio.wait_for(reader.readexactly(1), 15))[0])
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)


def test_one_peer_takes_one_state_slot_however_many_streams_it_opens(dhts):
    with group(dhts, n=2) as (a, stranger):
        release, calls, answered = threading.Event(), [], []
        a.state_provider = blocking_provider(release, calls)
        future = stranger._link.submit(ask_for_state(stranger, a, 4, answered))
        deadline = time.monotonic() + 5
        while len(answered) < 3 and time.monotonic() < deadline:  # the refusals come at once
            time.sleep(0.05)
        release.set()
        future.result(timeout=20)
        assert sorted(answered) == [wire.OK] + [wire.MISSING] * 3 and calls == [1]


def test_state_requests_do_not_hold_up_payload_validation(dhts):
    with group(dhts, n=3) as (a, b, stranger):
        release, calls, answered = threading.Event(), [], []
        a.state_provider = blocking_provider(release, calls)
        for backend in (a, b):
            backend.payload_validator = valid
        future = stranger._link.submit(ask_for_state(stranger, a, 8, answered))
        try:
            results, _ = gather([(a, filled(1)), (b, filled(2))])
            assert [sorted(firsts(r)) for r in results] == [[1, 2], [1, 2]]
        finally:
            release.set()
            future.result(timeout=30)


def test_state_downloads_are_counted_apart_from_the_gather_streams(dhts):
    with group(dhts, n=2) as (a, b):
        a.state_provider = lambda: {"w": torch.ones(5)}
        gather([(a, filled(1)), (b, filled(2))])
        gathered = (b.stats.bytes_sent, b.stats.bytes_received)
        b.load_state_from_peers(prefer=[a.peer_id])
        blob = dump_state({"step": 1, "state": {"w": torch.ones(5)}})
        # first the digest request and its answer (status, step, a sha256 in hex), then the state of step 1
        asks = len(wire.DIGEST_MAGIC) + len(wire.STATE_AT_MAGIC) + wire.U64.size
        answers = (1 + wire.U64.size + wire.U32.size + 64) + (1 + wire.U64.size + len(blob))
        assert (b.state_stats.bytes_sent, b.state_stats.bytes_received) == (asks, answers)
        assert (a.state_stats.bytes_sent, a.state_stats.bytes_received) == (answers, asks)
        assert (b.stats.bytes_sent, b.stats.bytes_received) == gathered


def test_close_ends_a_waiting_gather_with_a_backend_error(dhts):
    slow = {"step_timeout_s": 60.0}  # b's stream waits for b's round, a's round for b's payload
    with group(dhts, n=2, options={0: slow, 1: slow}) as (a, b):
        outcome = {}

        def wait_for_b():
            try:
                a.all_gather(filled(1))  # b never joins this round: a waits for it
            except Exception as exc:  # noqa: BLE001
                outcome["error"] = exc

        thread = threading.Thread(target=wait_for_b, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not a._book.rounds and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        a.close()
        thread.join(10)
        assert isinstance(outcome.get("error"), HivemindBackendError)
        assert time.monotonic() - start < 10


def test_close_ends_a_wait_for_peers(dhts):
    with group(dhts, n=1) as (a,):
        counts = []
        thread = threading.Thread(target=lambda: counts.append(a.wait_for_peers(5, 60)), daemon=True)
        thread.start()
        a.close()
        thread.join(10)
        assert counts == [0]
