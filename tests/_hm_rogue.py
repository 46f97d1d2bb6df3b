"""Test helper: a rogue peer that joins a run and sends garbage instead of payloads (127.0.0.1 only).

Run as ``python _hm_rogue.py <_hm_peer.py options>``. It builds the honest peers' model and optimizer to
learn the payload layout, then each step sends one kind of garbage, in turn:

* ``wrong-size``: a payload one byte short (refused at the hello, sender excluded)
* ``oversized``: a raw stream whose hello is right but whose payload frame claims 1 GiB and then
  keeps writing (must be refused unread, not buffered)
* ``bad-index``: a well-formed header, every index field set to all ones (out of range)
* ``nan``: a well-formed header and indices, the per-chunk scales set to NaN
* ``noise``: random bytes of the right size
"""

from __future__ import annotations

import asyncio
import sys
import time

import torch
from hivemind.p2p import PeerID

from distro_opt import PayloadLayout, param_spec
from distro_opt.comm import SingleWorkerBackend
from distro_opt.comm import hivemind_wire as wire
from distro_opt.volunteer import parse_args
from distro_opt.volunteer.program import make_backend
from distro_opt.volunteer.training import COMPRESSION, build

from _hm_peer import pop_option  # this script's directory, tests/, is on sys.path

MODES = ("wrong-size", "oversized", "bad-index", "nan", "noise")


def template(args) -> tuple[torch.Tensor, PayloadLayout]:
    """A valid payload of the honest layout, made by one local step."""
    captured = {}

    class Capture(SingleWorkerBackend):
        def all_gather(self, buf):
            captured["buf"] = buf.clone()
            return super().all_gather(buf)

    task, model, opt = build(args, Capture())
    x, y = task.batch(99, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    layout = PayloadLayout(
        [
            param_spec(p.shape, COMPRESSION["topk"], COMPRESSION["chunk"], COMPRESSION["bits"])
            for p in model.parameters()
        ]
    )
    assert layout.nbytes == captured["buf"].numel()
    return captured["buf"], layout


def garbage(mode: str, good: torch.Tensor, layout: PayloadLayout, rng: torch.Generator) -> torch.Tensor:
    buf = good.clone()
    if mode == "wrong-size":
        return buf[:-1].clone()
    if mode == "noise":
        return torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=rng)
    for seg in layout.segments:
        if mode == "bad-index":
            buf[seg.offset : seg.offset + seg.index_nbytes] = 255
        elif mode == "nan":
            scales = 2 * seg.num_chunks  # bf16 scale per chunk at the end of the values
            buf[seg.offset + seg.nbytes - scales : seg.offset + seg.nbytes] = torch.tensor(
                [0xC0, 0x7F], dtype=torch.uint8
            ).repeat(seg.num_chunks)
    return buf


async def flood(backend, peer: str, step: int, nbytes: int) -> str:
    """Open a gather stream with a valid hello, then claim a 1 GiB payload and keep writing."""
    _, reader, writer = await backend._link.p2p.call_binary_stream_handler(
        PeerID.from_base58(peer), f"distro/{backend.run_id}/gather"
    )
    try:
        writer.write(wire.HELLO.pack(wire.GATHER_MAGIC, wire.VERSION, 0, step, nbytes))
        status = (await asyncio.wait_for(reader.readexactly(1), 5))[0]
        if status != wire.OK:
            return f"status {status}"
        writer.write(wire.U64.pack(1 << 30))
        chunk = bytes(1 << 16)
        for _ in range(64):  # up to 4 MiB; the receiver should close long before
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 2)
        return "not closed"
    except Exception as exc:  # noqa: BLE001 - the honest peer is expected to hang up
        return f"closed: {type(exc).__name__}"
    finally:
        writer.close()


def main() -> int:
    argv = sys.argv[1:]
    step_delay_s = pop_option(argv, "--step-delay-s", float, 0.0)
    args = parse_args(argv)
    good, layout = template(args)
    backend = make_backend(args)
    rng = torch.Generator().manual_seed(7)
    print(f"rogue {backend.peer_id}", flush=True)
    try:
        backend.wait_for_peers(args.min_peers - 1, args.wait_peers_s)
        step = 0
        while backend.step < args.steps and step < 4 * args.steps:
            mode = MODES[step % len(MODES)]
            if mode == "oversized":
                honest = list(backend.membership.view())
                results = [
                    backend._link.call(flood(backend, p, backend.step, good.numel()), 30) for p in honest
                ]
                print(f"rogue oversized {results}", flush=True)
            backend.all_gather(garbage(mode, good, layout, rng) if mode != "oversized" else good)
            print(f"rogue step {step} sent {mode}", flush=True)
            step += 1
            time.sleep(step_delay_s)
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
