"""Frames of the hivemind backend's streams, and the rule that turns votes into a step's contributor set
(no single voter can veto, ``agree``).

Gather stream (one per ordered pair of peers and step; the opener pushes, the acceptor listens):

    opener   -> HELLO(magic, version, flags, step, nbytes)
    acceptor -> STATUS (1 byte: OK, LATE = step already finished here, REJECTED, BAD_SIZE)
    sender   -> PAYLOAD(u64 length | bytes)      then, once its gather phase ended,
    sender   -> VOTE(u32 length | u64 step | sorted 8-byte digests of the payloads it holds)

With ``flags & REPLY`` (a client-mode opener, which cannot accept streams) the acceptor sends its
own PAYLOAD and VOTE back on the same stream. A sender that is behind the step (a peer answered it
LATE) closes the stream without a VOTE: it abstains.

State stream (a joining peer asks a live one):

    opener   -> STATE_MAGIC
    acceptor -> STATUS (OK, or MISSING: no state served to this peer now), then STATE(u64 length | blob)

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
STATE_MAGIC = b"DHS1"
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


VETO_QUORUM = 2  # a payload leaves a step when at least this many voters lack it


def agree(held: dict[str, bytes], votes: dict[str, frozenset[bytes]]) -> tuple[list[str], bool]:
    """The contributors of a step, and whether this peer misses one of them.

    ``held`` maps each payload this peer received in time (its own included) to its digest; ``votes``
    maps each peer whose payload is held to that peer's vote (the digests it holds). The ballots are
    this peer's own (``held``) and the votes. A digest named on some ballot is a contributor unless
    at least ``VETO_QUORUM`` ballots lack it; this peer applies the contributors it holds itself.

    Why not an intersection (every ballot must hold it): then one voter removes any payload, and a
    rogue whose vote lists only its own payload makes every honest peer apply only the rogue's. With
    a quorum of two, no single voter takes an honest payload out, whatever it votes.

    Why a count of ballots that *lack* a payload, not of those that hold it: the ballots differ
    between peers exactly where delivery failed. A peer that lacks X's payload also lacks X's vote,
    but X's vote never lacks X's own payload, so every peer counts the same lacks for X. Hence, when
    every vote reaches every voter, honest peers keep the same payloads in the same (sorted peer id)
    order: a payload that reached all voters but one is kept, and the one that lacks it (the second
    return value is True) applies nothing and reloads state, as a peer that finds a step finished
    without it does; a payload that reached fewer is dropped everywhere. A sender that sent different
    payloads to different peers splits them over different digests, each lacked by the rest. A digest
    that no ballot but a rogue's names is lacked by every honest ballot, so it is dropped once two
    honest voters take part; nobody's claim makes this peer apply bytes it did not receive and
    validate itself. Votes of peers whose payload is not held are ignored, so a stranger cannot vote
    without contributing. Two rogues that vote together can still veto (the run's guarantees, in
    docs/volunteers.md, count them).
    """
    ballots = [frozenset(held.values()), *(v for voter, v in votes.items() if voter in held)]
    named = set().union(*ballots)
    carried = {d for d in named if sum(d not in b for b in ballots) < VETO_QUORUM}
    agreed = sorted(p for p, d in held.items() if d in carried)
    return agreed, not carried <= set(held.values())


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
