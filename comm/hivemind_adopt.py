"""Adopting another peer's result for a round, and serving ours: the round logs of the hivemind backend.

``Adoption`` is a mixin of ``HivemindBackend``. A peer keeps the contributors and payloads of its last
``log_rounds`` rounds. Two kinds of peer ask for one:

* a peer that got LATE (a peer finished the step without it, or its gather phase is over). A LATE
  answer alone proves nothing: any peer can send one. A peer that holds no payload but its own has
  nothing to vote on, so it applies what a LATE peer applied (re-asking one that is still adopting
  until its deadline), or flags ``out_of_sync``. A peer that holds payloads tries the log of a LATE
  peer only when that peer is a *known contributor* (it contributed to this peer's last logged round
  and is still active; in a peer's first round after a start or a reload: any active peer of its
  view), and only before its vote; when no such log passes, it votes as usual;
* a peer that saw a vote listing payloads it never received (a better-informed voter) applies that
  voter's set. A voter whose vote strictly contains ours is re-asked while it is adopting itself
  (strict containment cannot form a cycle); when no final log passes, the peer applies its own
  agreement and flags ``out_of_sync``. A round that ended flagged serves no log.

A log is served by a stranger, so nothing in it is taken on its word:

* an entry for a payload this peer holds must carry the digest of the payload it holds (and this
  peer's own bytes are used); a LATE peer's log must not name this peer (a peer that answered our
  push LATE never received our payload);
* any other entry must name an admissible peer (allow list, exclusions), pass ``payload_validator``
  like a pushed payload (all of them at once, within the step deadline), and be vouched for by
  someone other than the server. Late path: the server vouches for its own payload; each other
  sender that is active and not in client mode in our view is asked for its log header (each
  request has ``VOUCH_FRACTION * step_timeout_s``): one that lists a different digest refutes the
  log; one that cannot answer (departed, crashed, frozen) neither refutes nor confirms it. Informed
  path: another voter's vote must list the digest. A voter that invents a digest therefore cannot
  make others apply payloads it made up for reachable peers; at most it serves a subset of what they
  hold, which its vote alone could already do.

A log that fails any check is refused as a whole (applying part of it would silently differ from
what its server applied); the peer then tries the next server.

Deadlock: a server waits for its own round's decision before answering, never for another peer's
log. One that is itself adopting answers at once PROVISIONAL with its own agreement, so two peers
that each think the other better informed finish at once instead of both waiting for the deadline.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import PeerID

from . import hivemind_wire as wire
from .hivemind_membership import ACTIVE
from .hivemind_round import Round

logger = logging.getLogger(__name__)

VOUCH_FRACTION = 0.1  # each sender asked to vouch for its payload has this much of step_timeout_s
RETRY_S = 0.05  # how often a peer re-asks a server that answered PROVISIONAL (still adopting)


class LogRefused(ValueError):
    """A round log that this peer must not apply; the message says why."""


class _NoAnswer(Exception):
    """A log server did not start answering within the time it was given."""


class Adoption:
    """Round logs: fetching, checking and serving them (mixin)."""

    def _known_contributors(self, active: set[str]) -> set[str]:
        """Peers whose LATE answer may end our round early: the contributors of our last logged round
        that are still ``active``; with no logged round yet (first round, after a reload), ``active``."""
        for step in sorted(self._log, reverse=True):
            if self._log[step]:
                return {p for p, _ in self._log[step]} & active
        return set(active)

    async def _adopt_finished(self, r: Round, late: list[str], held: dict, *, final: bool):
        """Late path: what a peer that answered LATE applied, checked. ``final`` (we hold no payload
        but ours): re-ask servers still adopting until the deadline, else flag ``out_of_sync`` and
        return ``[]``. Otherwise one try, before half the time to our vote deadline; ``None`` if no
        log passed (the caller then votes as usual)."""
        loop = asyncio.get_running_loop()
        if final:
            r.adopting = True  # we will not vote: log requests to us get MISSING at once
            r.phase1.set()  # and our push streams end now, so that nobody waits for our vote
            r.notify()
            deadline, retry = r.deadline, late
        else:
            now = loop.time()
            deadline, retry = now + max(0.0, r.vote_deadline - now) / 2, ()
        result = await self._adopt(r, late, held, self._vouched_by_senders, deadline, retry, late=True)
        if result is None and final:
            logger.warning("step %d finished without us and no acceptable log came: out of sync", r.step)
            self.out_of_sync = r.flagged = True
            return []
        return result

    async def _adopt_informed(self, r: Round, informed, held, votes, agreed) -> list[tuple[str, bytes]]:
        """Informed path: a better-informed voter's applied set, checked; else our own ``agreed`` set,
        flagged ``out_of_sync``. Voters whose vote strictly contains ours are asked first and re-asked
        while they adopt themselves (they never adopt from us, so this cannot cycle)."""
        r.agreed, r.agreed_digests, r.adopting = agreed, held, True  # served PROVISIONAL meanwhile
        r.notify()
        mine = set(held.values())
        wider = [q for q in informed if votes[q] > mine]

        async def vouched(_r, server, unknown):
            # a payload only the server's vote lists may be one it invented: another voter must hold it
            return all(any(d in v for q, v in votes.items() if q != server) for d in unknown.values())

        servers = wider + [q for q in informed if q not in wider]
        adopted = await self._adopt(r, servers, held, vouched, r.deadline, wider)
        if adopted is not None:
            return adopted
        logger.warning("step %d: no better-informed peer served an acceptable log: out of sync", r.step)
        self.out_of_sync = r.flagged = True
        return agreed

    async def _adopt(self, r, servers, held, vouch, deadline, retry=(), late=False):
        """The first acceptable final log of ``servers`` for round ``r`` (or ``None``). In a first pass
        each server but the last has ``VOUCH_FRACTION * step_timeout_s`` to start answering (a frozen
        one must not use up the deadline); those that did not, and servers in ``retry`` that answer
        PROVISIONAL (adopting themselves), are asked again until ``deadline``."""
        loop = asyncio.get_running_loop()
        pending, first = list(servers), True
        while pending:
            again = []
            for i, peer in enumerate(pending):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                patient = not first or i == len(pending) - 1
                answer_s = None if patient else VOUCH_FRACTION * self.step_timeout_s
                try:
                    status, log, payloads = await asyncio.wait_for(
                        self._fetch_log(peer, r.step, len(r.own), answer_s=answer_s), remaining
                    )
                    if status == wire.PROVISIONAL:
                        again += [peer] if peer in retry else []
                        continue
                    return await self._accept_log(r, peer, log, payloads, held, vouch, deadline, late)
                except _NoAnswer:
                    again.append(peer)  # slow to answer: maybe still finishing its round, ask again
                except Exception as exc:  # noqa: BLE001 - ask the next peer
                    logger.debug("log of step %d from %s refused: %s: %s", r.step, peer, type(exc).__name__,
                                 exc)
            pending, first = again, False
            if pending:
                await asyncio.sleep(max(0.0, min(RETRY_S, deadline - loop.time())))
        return None

    async def _accept_log(self, r, server, log, payloads, held, vouch, deadline, late=False):
        """``payloads`` of ``server``'s log as this peer will apply them, or raise ``LogRefused``."""
        if late and self.peer_id in log:
            raise LogRefused("a peer that answered us LATE cannot hold our payload")
        mismatch = [p for p, d in log.items() if p in held and held[p] != d]
        if mismatch:
            raise LogRefused(f"log differs from the payloads this peer holds for {len(mismatch)} peer(s)")
        unknown = {p: d for p, d in log.items() if p not in held}
        if any(not self._admissible(p) for p in unknown):
            raise LogRefused("log names a peer that is not admissible here")
        if unknown and not await vouch(r, server, unknown):
            raise LogRefused("log holds payloads nobody but its server vouches for")
        new = [(p, data) for p, data in payloads if p not in held]
        if new and self.payload_validator is not None:
            remaining = deadline - asyncio.get_running_loop().time()
            try:  # all at once, within the deadline: a slow validator must not overrun the step
                ok = await asyncio.wait_for(asyncio.gather(*(self._validate(d) for _, d in new)), remaining)
            except asyncio.TimeoutError:
                raise LogRefused("log payloads not validated before the step deadline") from None
            bad = [p for (p, _), good in zip(new, ok) if not good]
            if bad:
                raise LogRefused(f"log payload of {bad[0]} failed the payload validator")
        own = {self.peer_id: r.own, **r.payloads}
        return [(p, own[p] if p in held else data) for p, data in payloads]

    async def _vouched_by_senders(self, r, server, unknown: dict[str, bytes]) -> bool:
        """Late path: the server vouches for its own payload. Every other sender that is active and
        reachable (not in client mode) in our view is asked for its header, each for a short time; one
        that lists a different digest for its own payload refutes the log. A sender that cannot answer
        (departed, crashed, frozen, client mode) neither refutes nor confirms it."""
        view = self.membership.view()
        ask = [
            p for p in unknown
            if p != server and p in view and view[p].state == ACTIVE and not view[p].client
        ]
        if not ask:
            return True
        loop = asyncio.get_running_loop()
        timeout = min(VOUCH_FRACTION * self.step_timeout_s, r.deadline - loop.time())
        if timeout <= 0:
            return False
        heads = await asyncio.gather(
            *(asyncio.wait_for(self._fetch_log(p, r.step, len(r.own), payloads=False), timeout) for p in ask),
            return_exceptions=True,
        )
        refuted = [
            p for p, h in zip(ask, heads)
            if not isinstance(h, BaseException) and h[0] == wire.OK and p in h[1] and h[1][p] != unknown[p]
        ]
        if refuted:
            logger.warning("step %d: %s's log is refuted by %d sender(s)", r.step, server, len(refuted))
        return not refuted

    async def _fetch_log(self, peer: str, step: int, nbytes: int, payloads: bool = True, answer_s=None):
        """``(status, {peer: digest}, [(peer, bytes)])`` of ``peer``'s round ``step``; every byte is
        counted in ``stats`` (a chronically late peer gets all its payloads this way). ``answer_s``:
        how long the stream and status may take (``_NoAnswer`` after that)."""
        opening = self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), f"distro/{self.run_id}/log")
        try:
            _, reader, writer = await asyncio.wait_for(opening, answer_s)
        except asyncio.TimeoutError:
            raise _NoAnswer from None
        try:
            writer.write(wire.LOG_REQUEST.pack(wire.LOG_MAGIC if payloads else wire.LOG_HEAD_MAGIC, step))
            self._count_sent(wire.LOG_REQUEST.size)
            try:
                status = (await asyncio.wait_for(reader.readexactly(1), answer_s))[0]
            except asyncio.TimeoutError:
                raise _NoAnswer from None
            self._count_received(1)
            if status not in (wire.OK, wire.PROVISIONAL):
                raise LogRefused(f"peer has no log of step {step}")
            header = await wire.read_frame(
                reader, wire.U32, wire.MAX_LOG_ENTRY_NBYTES * self.max_peers, "log"
            )
            self._count_received(wire.U32.size + len(header))
            log = wire.decode_log(header, step)
            if not log or len(log) > self.max_peers:
                raise LogRefused("log has no or too many contributors")
            if status == wire.PROVISIONAL or not payloads:
                return status, log, []
            out = []
            for p in sorted(log):
                out.append((p, await reader.readexactly(nbytes)))
                self._count_received(nbytes)
            if any(wire.digest(p, b) != log[p] for p, b in out):
                raise LogRefused("log payload does not match its digest")
            return status, log, out
        finally:
            writer.close()

    def _log_head(self, step: int, entries) -> dict[str, bytes]:
        """The digests of a logged round, hashed once per round, not once per request."""
        cached = self._log_heads.get(step)
        if cached is None or cached[0] is not entries:
            cached = self._log_heads[step] = (entries, {p: wire.digest(p, b) for p, b in entries})
            for old in [s for s in self._log_heads if s not in self._log and s != step]:
                del self._log_heads[old]
        return cached[1]

    async def _log_answer(self, step: int):
        """``(status, entries, digests)`` for round ``step``: our applied set, or our own agreement
        while we adopt (PROVISIONAL); a round that ended out of sync has no log."""
        r = self._rounds.get(step)
        if r is not None and r.own_ready.is_set():
            # wait for this round's own decision, never for another peer's log (no wait cycles)
            deadline = asyncio.get_running_loop().time() + self.step_timeout_s
            await r.wait_until(lambda: r.finished.is_set() or r.adopting, deadline)
            if not r.finished.is_set():
                if not r.agreed:
                    return wire.MISSING, None, None
                return wire.PROVISIONAL, r.agreed, {p: r.agreed_digests[p] for p, _ in r.agreed}
        entries = self._log.get(step)
        if not entries:
            return wire.MISSING, None, None
        return wire.OK, entries, self._log_head(step, entries)

    async def _on_log(self, info, reader, writer) -> None:
        try:
            magic, step = wire.LOG_REQUEST.unpack(
                await asyncio.wait_for(reader.readexactly(wire.LOG_REQUEST.size), 5)
            )
            self._count_received(wire.LOG_REQUEST.size)
            if magic not in (wire.LOG_MAGIC, wire.LOG_HEAD_MAGIC) or not self._admissible(
                info.peer_id.to_base58()
            ):
                self._answer(writer, wire.REJECTED)
                return
            status, entries, digests = await self._log_answer(step)
            self._answer(writer, status)
            if status == wire.MISSING:
                return
            header = wire.encode_log(step, digests)
            self._count_sent(wire.U32.size + len(header))
            await asyncio.wait_for(wire.write_frame(writer, wire.U32, header), self.step_timeout_s)
            if status == wire.OK and magic == wire.LOG_MAGIC:
                for _, b in entries:
                    self._count_sent(len(b))
                    writer.write(b)
                await asyncio.wait_for(writer.drain(), self.step_timeout_s)
        except asyncio.CancelledError:
            pass  # the backend is closing: asyncio would print the cancellation as an error
        except Exception as exc:  # noqa: BLE001
            logger.debug("log request failed: %s", exc)
        finally:
            writer.close()
