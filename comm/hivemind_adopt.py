"""Adopting another peer's result for a round, and serving ours: the round logs of the hivemind backend.

``Adoption`` is a mixin of ``HivemindBackend``. A peer keeps the contributors and payloads of its last
``log_rounds`` rounds. Two kinds of peer ask for one:

* a peer that got LATE from some peers (they finished the step without it) applies exactly what a
  finished peer applied;
* a peer that saw a vote listing payloads it never received (a better-informed voter) applies that
  voter's set.

A log is served by a stranger, so nothing in it is taken on its word:

* an entry for a payload this peer holds must carry the digest of the payload it holds (and this
  peer's own bytes are used);
* any other entry must name an admissible peer (allow list, exclusions), pass ``payload_validator``
  like a pushed payload, and be vouched for by someone other than the server: by its sender's own
  log (late path; a finished peer vouches for its own payload) or by another voter's vote (informed
  path). A voter that invents a digest therefore cannot make others apply payloads it made up; at
  most it serves a subset of what they hold, which its vote alone could already do.

A log that fails any check is refused as a whole (applying part of it would silently differ from
what its server applied); the peer then tries the next server, and marks itself ``out_of_sync`` when
none served an acceptable log.

Deadlock: a server waits for its own round's decision before answering, never for another peer's
log. One that is itself adopting answers at once PROVISIONAL with its own agreement, so two peers
that each think the other better informed finish at once instead of both waiting for the deadline.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import PeerID

from . import hivemind_wire as wire
from .hivemind_round import Round

logger = logging.getLogger(__name__)


class LogRefused(ValueError):
    """A round log that this peer must not apply; the message says why."""


class Adoption:
    """Round logs: fetching, checking and serving them (mixin)."""

    async def _adopt_finished(self, r: Round, late: list[str], held: dict) -> list[tuple[str, bytes]]:
        """Late path: what a peer that answered LATE applied, checked; else nothing and out_of_sync."""
        r.adopting = True  # we will not vote: log requests to us get MISSING at once
        r.notify()
        result, _ = await self._adopt(r, late, held, self._vouched_by_senders)
        if result is None:
            logger.warning("step %d finished without us and no acceptable log came: out of sync", r.step)
            self.out_of_sync = True
        return result or []

    async def _adopt_informed(self, r: Round, informed, held, votes, agreed) -> list[tuple[str, bytes]]:
        """Informed path: a better-informed voter's applied set, checked; else our own ``agreed`` set,
        flagged ``out_of_sync`` unless every such voter was adopting too and agreed with us."""
        r.agreed, r.adopting = agreed, True  # served PROVISIONAL to peers that adopt from us meanwhile
        r.notify()

        async def vouched(_r, server, unknown):
            # a payload only the server's vote lists may be one it invented: another voter must hold it
            return all(any(d in v for q, v in votes.items() if q != server) for d in unknown.values())

        adopted, provisional = await self._adopt(r, informed, held, vouched)
        if adopted is not None:
            return adopted
        mine = {p: held[p] for p, _ in agreed}
        if len(provisional) < len(informed) or any(log != mine for log in provisional):
            logger.warning("step %d: no better-informed peer served an acceptable log: out of sync", r.step)
            self.out_of_sync = True
        return agreed

    async def _adopt(self, r, servers, held, vouch) -> tuple[list | None, list[dict]]:
        """The first acceptable final log of ``servers`` for round ``r``, and the PROVISIONAL answers
        (each a ``{peer: digest}`` agreement) of servers that were adopting themselves."""
        loop = asyncio.get_running_loop()
        provisional = []
        for peer in servers:
            remaining = r.deadline - loop.time()
            if remaining <= 0:
                break
            try:
                status, log, payloads = await asyncio.wait_for(
                    self._fetch_log(peer, r.step, len(r.own)), remaining
                )
                if status == wire.PROVISIONAL:
                    provisional.append(log)
                    continue
                return await self._accept_log(r, peer, log, payloads, held, vouch), provisional
            except Exception as exc:  # noqa: BLE001 - ask the next peer
                logger.debug("log of step %d from %s refused: %s: %s", r.step, peer, type(exc).__name__, exc)
        return None, provisional

    async def _accept_log(self, r, server, log, payloads, held, vouch) -> list[tuple[str, bytes]]:
        """``payloads`` of ``server``'s log as this peer will apply them, or raise ``LogRefused``."""
        mismatch = [p for p, d in log.items() if p in held and held[p] != d]
        if mismatch:
            raise LogRefused(f"log differs from the payloads this peer holds for {len(mismatch)} peer(s)")
        unknown = {p: d for p, d in log.items() if p not in held}
        if any(not self._admissible(p) for p in unknown):
            raise LogRefused("log names a peer that is not admissible here")
        if unknown and not await vouch(r, server, unknown):
            raise LogRefused("log holds payloads nobody but its server vouches for")
        out = []
        for p, data in payloads:
            if p in held:
                out.append((p, r.own if p == self.peer_id else r.payloads[p]))
            elif self.payload_validator is not None and not await self._validate(data):
                raise LogRefused(f"log payload of {p} failed the payload validator")
            else:
                out.append((p, data))
        return out

    async def _vouched_by_senders(self, r, server, unknown: dict[str, bytes]) -> bool:
        """Late path: the server vouches for its own payload; every other payload's sender must list
        the same digest in its own log (a header-only request to each, in parallel)."""
        others = [p for p in unknown if p != server]
        if not others:
            return True
        remaining = max(0.01, r.deadline - asyncio.get_running_loop().time())
        heads = await asyncio.gather(
            *(asyncio.wait_for(self._fetch_log(p, r.step, len(r.own), payloads=False), remaining)
              for p in others),
            return_exceptions=True,
        )
        return all(
            not isinstance(h, BaseException) and h[0] == wire.OK and h[1].get(p) == unknown[p]
            for p, h in zip(others, heads)
        )

    async def _fetch_log(self, peer: str, step: int, nbytes: int, payloads: bool = True):
        """``(status, {peer: digest}, [(peer, bytes)])`` of ``peer``'s round ``step``; every byte is
        counted in ``stats`` (a chronically late peer gets all its payloads this way)."""
        _, reader, writer = await self._p2p.call_binary_stream_handler(
            PeerID.from_base58(peer), f"distro/{self.run_id}/log"
        )
        try:
            writer.write(wire.LOG_REQUEST.pack(wire.LOG_MAGIC if payloads else wire.LOG_HEAD_MAGIC, step))
            self._count_sent(wire.LOG_REQUEST.size)
            status = (await reader.readexactly(1))[0]
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

    async def _log_answer(self, step: int) -> tuple[int, list[tuple[str, bytes]] | None]:
        """What we can say about round ``step``: our applied set, or our own agreement while we adopt."""
        r = self._rounds.get(step)
        if r is not None and r.own_ready.is_set():
            # wait for this round's own decision, never for another peer's log (no wait cycles)
            deadline = asyncio.get_running_loop().time() + self.step_timeout_s
            await r.wait_until(lambda: r.finished.is_set() or r.adopting, deadline)
            if not r.finished.is_set():
                return (wire.PROVISIONAL, r.agreed) if r.agreed else (wire.MISSING, None)
        entries = self._log.get(step)
        return (wire.OK, entries) if entries else (wire.MISSING, None)

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
            status, entries = await self._log_answer(step)
            self._answer(writer, status)
            if status == wire.MISSING:
                return
            header = wire.encode_log(step, {p: wire.digest(p, b) for p, b in entries})
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
