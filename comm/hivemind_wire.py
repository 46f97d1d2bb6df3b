"""Frames of the hivemind backend's streams, and the rule that turns votes into a step's contributor set.

Gather stream (one per ordered pair of peers and step; the opener pushes, the acceptor listens):

    opener   -> HELLO(magic, version, flags, step, nbytes)
    acceptor -> STATUS (1 byte: OK, LATE = step already finished here, REJECTED, BAD_SIZE)
    sender   -> PAYLOAD(u64 length | bytes)      then, once its gather phase ended,
    sender   -> VOTE(u32 length | u64 step | sorted 8-byte digests of the payloads it holds)

With ``flags & REPLY`` (a client-mode opener, which cannot accept streams) the acceptor sends its
own PAYLOAD and VOTE back on the same stream. A sender that is behind the step (a peer answered it
LATE) closes the stream without a VOTE: it abstains.

State stream (a joining peer asks a live one), one of three requests:

    opener   -> STATE_MAGIC                      the state as it is now
    opener   -> STATE_AT_MAGIC | u64 step         the state after ``step`` steps, if it still is
    acceptor -> STATUS (OK, or MISSING: no such state served to this peer now), then STATE(u64 length | blob)

    opener   -> DIGEST_MAGIC                     what the state is now, in a few bytes
    acceptor -> STATUS, then u64 step | DIGEST(u32 length | the state's digest, at most 64 bytes)

Every read is bounded in size before it is made: a length field above what this peer expects
closes the stream without reading the body.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct

GATHER_MAGIC = b"DHG1"
HELLO = struct.Struct(">4sBBQQ")
VERSION = 1
FLAG_REPLY = 1
OK, LATE, REJECTED, BAD_SIZE, MISSING = 0, 1, 2, 3, 4
U32, U64 = struct.Struct(">I"), struct.Struct(">Q")
STATE_MAGIC, STATE_AT_MAGIC, DIGEST_MAGIC = b"DHS1", b"DHS2", b"DHD1"
MAX_STATE_DIGEST_NBYTES = 64
DIGEST_NBYTES = 8


class WireError(ValueError):
    """A peer sent a frame that breaks the protocol; the message says how."""


def digest(peer: str, payload: bytes) -> bytes:
    """8-byte fingerprint of (sender, payload): votes name payloads by it, so two different payloads
    of one sender (equivocation) never match, and two senders of equal bytes never collide."""
    return hashlib.blake2b(peer.encode() + b"\0" + payload, digest_size=DIGEST_NBYTES).digest()


def vote_limit(max_peers: int) -> int:
    """The largest vote a peer accepts: the step number and one digest per possible contributor."""
    return U64.size + DIGEST_NBYTES * (max_peers + 1)


def encode_vote(step: int, digests) -> bytes:
    """A vote: u64 step | the sorted digests of every payload the voter holds (its own included)."""
    return U64.pack(step) + b"".join(sorted(digests))


def decode_vote(data: bytes, step: int) -> frozenset[bytes]:
    if len(data) < U64.size or (len(data) - U64.size) % DIGEST_NBYTES:
        raise WireError("vote is not a step number followed by whole digests")
    if U64.unpack(data[: U64.size])[0] != step:
        raise WireError(f"vote is not for step {step}")
    return frozenset(data[i : i + DIGEST_NBYTES] for i in range(U64.size, len(data), DIGEST_NBYTES))


def agree(
    held: dict[str, bytes], votes: dict[str, frozenset[bytes]], refused_voters=frozenset()
) -> list[str]:
    """The contributors of a step: the payloads this peer holds that every vote also holds.

    ``held`` maps each payload this peer received in time (its own included) to its digest; ``votes``
    maps each peer whose payload is held to that peer's vote (the digests it holds). When every
    voter's vote reaches every other voter, all peers compute the same intersection, so they apply
    the same set of payloads in the same (sorted peer id) order. A payload that reached only some
    peers is dropped everywhere; a sender that sent different payloads to different peers (different
    digests) is dropped too. Votes of peers whose payload is not held are ignored, so a stranger
    cannot veto by voting alone. A vote can only take payloads out: digests in it that this peer does
    not hold add nothing (nobody's claim to hold a payload makes this peer apply bytes it did not
    receive and validate itself).

    ``refused_voters`` (where strangers may contribute: ``refused(held, votes)``) are taken out
    first, their payloads with them: one rogue voting for its own payload alone would otherwise
    make every peer apply that payload alone. A rogue can still drop up to half of the others.
    """
    held = {p: d for p, d in held.items() if p not in refused_voters}
    agreed = dict(held)
    for voter, vote in votes.items():
        if voter in held:
            agreed = {p: d for p, d in agreed.items() if d in vote}
    return sorted(agreed)


def refused(held: dict[str, bytes], votes: dict[str, frozenset[bytes]]) -> set[str]:
    """The voters whose vote lacks more than half of the other payloads held (when two or more are).

    Such a vote would veto most of the step. A late payload or a vanished sender makes a peer lack
    one or a few payloads, which the intersection drops as before; a peer that received most of
    the step too late is refused by the others, applies a different set and is brought back by the
    replica checksum.
    """
    out = set()
    for voter, vote in votes.items():
        others = [d for p, d in held.items() if p != voter]
        lacked = sum(d not in vote for d in others)
        if len(others) >= 2 and 2 * lacked > len(others):
            out.add(voter)
    return out


async def read_frame(
    reader: asyncio.StreamReader, header: struct.Struct, max_nbytes: int, what: str
) -> bytes:
    """Read a length-prefixed frame whose length must be <= ``max_nbytes`` (else refuse it unread)."""
    (n,) = header.unpack(await reader.readexactly(header.size))
    if n > max_nbytes:
        raise WireError(f"{what} of {n} bytes refused (at most {max_nbytes} expected)")
    return await reader.readexactly(n)


async def write_frame(writer: asyncio.StreamWriter, header: struct.Struct, data: bytes) -> int:
    writer.write(header.pack(len(data)))
    writer.write(data)
    await writer.drain()
    return header.size + len(data)
