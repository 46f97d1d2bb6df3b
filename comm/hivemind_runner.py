"""One round of the hivemind backend, phase by phase: gather, then agree.

``hivemind_backend``'s module docstring describes the phases; here they are in order, in
``RoundRunner._phases``. The streams that move the bytes are ``GatherStreams``; the rule that turns
votes into contributors is ``hivemind_wire.agree``. Nothing another peer relays is applied: every
payload of a result came from its sender's own stream and passed this peer's validator.
"""

from __future__ import annotations

import asyncio
import logging

from . import hivemind_wire as wire
from .base import CommStats
from .hivemind_admission import Admission
from .hivemind_membership import ACTIVE, Membership, PeerRecord
from .hivemind_round import Round, RoundBook
from .hivemind_settings import VOTE_FRACTION, Settings
from .hivemind_streams import GatherStreams

logger = logging.getLogger(__name__)


class RoundRunner:
    """Runs this peer's rounds on the backend's event loop (``loop``), one coroutine per step."""

    def __init__(
        self,
        settings: Settings,
        peer_id: str,
        *,
        book: RoundBook,
        admission: Admission,
        membership: Membership,
        streams: GatherStreams,
        stats: CommStats,
        loop: asyncio.AbstractEventLoop,
    ):
        self.settings, self.peer_id = settings, peer_id
        self.book, self.admission, self.membership = book, admission, membership
        self.streams, self.stats, self.loop = streams, stats, loop
        # the others whose payloads the last finished round applied, with their records: the next
        # round waits for them even if they are not (or no longer) in the view (see _expected)
        self.recent: dict[str, PeerRecord] = {}

    async def run(self, step: int, payload: bytes) -> list[tuple[str, bytes]]:
        """Round ``step`` with our ``payload``: the (peer, payload) pairs to apply, sorted by peer id."""
        r = self.book.round(step)
        try:
            return await self._phases(r, payload)
        finally:
            if not r.finished.is_set():  # cancelled or failed: close it still, or it holds back `low`
                self._finish(r, [])

    async def _phases(self, r: Round, payload: bytes) -> list[tuple[str, bytes]]:
        settings, step, now = self.settings, r.step, self.loop.time()
        r.gather_deadline = now + settings.gather_fraction * settings.step_timeout_s
        r.vote_deadline = now + VOTE_FRACTION * settings.step_timeout_s
        r.deadline = now + settings.step_timeout_s
        r.own = payload
        r.own_ready.set()

        # 1. gather: push to every active peer we admit, collect theirs until the gather deadline
        view = self._expected()
        expected = {p for p, rec in view.items() if not (settings.client_mode and rec.client)}
        for p in expected:
            if not view[p].client and p not in r.pushed:  # it may have contacted us first
                self.streams.spawn_push(r, p)

        def gathered():
            # every peer's payload is here or will not come, and ours reached every peer we push to
            return all(p in r.payloads or p in r.no_payload for p in expected | r.streams) and all(
                p in r.push_over for p in r.pushed
            )

        await r.wait_until(gathered, r.gather_deadline)
        behind = sorted(p for p in r.late if p not in r.payloads and self.admission.admits(p))
        counted = {p for p in expected | r.streams | r.pushed if p != self.peer_id and self.admission.admits(p)}
        if behind and 2 * len(behind) >= len(counted):
            # half or more of this round's peers finished it without us and we never got their
            # payloads: we cannot apply what they applied. Abstain (our vote would make the peers
            # holding our payload drop the ones we miss, which those who finished never dropped) and
            # reload state afterwards. Half counts: in a run of three, a joiner told LATE by one peer
            # and served by the other would otherwise vote out the first one's payload at the second,
            # and the three would apply three different sets, which no checksum majority can heal.
            # One LATE answer in a run of four or more never reaches half, so a lone rogue cannot
            # make an honest peer of such a run reload.
            logger.warning("step %d finished without this peer at %s: out of sync", step, _short(behind))
            self.book.out_of_sync = True
            r.phase1.set()
            return self._finish(r, [])
        if behind:
            # A LATE answer proves nothing (a rogue can send one at every step to make the others
            # reload every step): from a minority it counts as a missing payload. Had it been true,
            # that peer applied another set than ours, which the replica checksum finds.
            logger.warning("step %d: %s answered LATE, less than half of the %d peers of the round; "
                           "going on without their payloads", step, _short(behind), len(counted))

        # 2. agree: vote the digests we hold to every peer whose payload we hold, wait for their votes
        held = {p: wire.digest(p, b) for p, b in [(self.peer_id, payload), *r.payloads.items()]}
        r.my_vote = wire.encode_vote(step, held.values())
        r.phase1.set()
        await r.wait_until(lambda: all(p in r.vote_done for p in r.payloads), r.vote_deadline)
        votes = {p: v for p, v in r.votes.items() if p in r.payloads}
        # a vote can only take payloads out; digests in it that we do not hold are claims we cannot
        # check, and count for nothing
        out = wire.refused(held, votes) if settings.untrusted_fraction > 0 else set()
        if out:
            logger.warning(
                "step %d: refused the votes of %s, each lacking most of the step", step, _short(out)
            )
        agreed = wire.agree(held, votes, out)
        # a peer can be in the result without being in our view: a joiner whose heartbeat has not
        # reached us yet pushed to us (r.streams), or a peer whose records we lost sight of (a DHT node
        # that held them left). Its stream told us whether it is a client-mode peer.
        self.recent = {
            p: view.get(p) or PeerRecord(ACTIVE, client=p in r.clients, step=step)
            for p in agreed if p != self.peer_id
        }
        result = [(p, payload if p == self.peer_id else r.payloads[p]) for p in agreed]
        logger.debug("step %d held %s, votes of %s -> %s", step, _short(held), _short(votes), _short(agreed))
        return self._finish(r, result)

    def _expected(self) -> dict[str, PeerRecord]:
        """The peers this round pushes to and waits for: the active peers of the view that we admit,
        and those whose payloads the last round applied, unless they announced a clean leave.

        A peer can be missing from the view while it trains with us: a heartbeat that missed its TTL
        once (a loaded machine, a slow DHT answer), a joiner whose first heartbeats have not reached us
        though it took part in the last round, a peer whose records were stored on a DHT node that has
        since left. A round that started then would not wait for it and apply a different set of
        payloads than that peer does; it would find the step finished without it and fall out of sync
        (with two honest peers no checksum majority would ever bring them back together). So a peer
        of the last step is waited for until the gather deadline: one slow round if it really
        crashed, a split never; one that announced its leave is not waited for at all."""
        seen = self.membership.view()
        view = {p: rec for p, rec in seen.items() if rec.state == ACTIVE}
        for p, rec in self.recent.items():
            if p not in view and not self.membership.has_left(p):
                view[p] = rec
        return {p: rec for p, rec in view.items() if self.admission.admits(p)}

    def _finish(self, r: Round, result):
        self.book.finish(r)
        # give votes in flight a moment to leave, then drop whatever still waits on this round
        self.loop.call_later(1.0, lambda: [t.cancel() for t in r.tasks])
        self.stats.record(0, 0)  # one more collective; its bytes were counted as they crossed
        return result


def _short(peers) -> list[str]:
    return sorted(p[-6:] for p in peers)
