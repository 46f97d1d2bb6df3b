"""Bit-identity of the optimizer step across a change of its code: 48 runs, hashed.

8 configurations x {1, 3 in-process workers} x {float32, bfloat16, float64} parameters, each run 6
steps of seeded gradients on a model of mixed shapes (matrices of 64x64 chunks and not, two
same-shaped neighbours, a vector, a 4-D kernel, a parameter shorter than a run). A run's hash is the
SHA-256 of every worker's final parameters and optimizer state, byte for byte. torch runs on one
intra-op thread here: with two, one of the 48 runs was seen to differ between processes now and then
(MKL's GEMMs are not bit-reproducible across thread teams), which would hide what a change did.

    python research/step_identity.py --save hashes.json     # before the change
    python research/step_identity.py --against hashes.json  # after: exit 1 on any difference
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings

import torch

from distro_opt import DeMo, DisTrOAdamW
from distro_opt.comm import InProcessBackend

SHAPES = [(96, 64), (128, 64), (128, 64), (64,), (8, 4, 3, 3), (10,), (100, 48)]
STEPS = 6

CONFIGS = {
    "defaults": lambda ps, b: DisTrOAdamW(ps, lr=0.01, comm=b),
    "adam-8bit": lambda ps, b: DisTrOAdamW(ps, lr=0.01, update="adam", compression_bits=8, comm=b),
    "rms-2bit-kept": lambda ps, b: DisTrOAdamW(
        ps, lr=0.01, update="rms", compression_bits=2, error_feedback="kept", comm=b
    ),
    "demo": lambda ps, b: DeMo(ps, lr=0.01, comm=b),
    "overlap-wd": lambda ps, b: DisTrOAdamW(ps, lr=0.01, weight_decay=0.1, overlap=True, comm=b),
    "local-steps": lambda ps, b: DisTrOAdamW(ps, lr=0.01, sync_every=3, comm=b),
    "chunk32-top8-16bit": lambda ps, b: DisTrOAdamW(
        ps, lr=0.01, compression_chunk=32, compression_topk=8, compression_bits=16, comm=b
    ),
    "trimmed-mean": lambda ps, b: DisTrOAdamW(ps, lr=0.01, comm=_untrusted(b)),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _untrusted(backend):
    backend.untrusted_fraction = 0.25  # the trimmed mean of robust.py (nothing trimmed on 1 worker)
    return backend


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _digest(params, opt) -> str:
    h = hashlib.sha256()
    tensors = list(params)
    for st in opt.state_dict()["state"].values():
        tensors += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run(config: str, workers: int, dtype) -> str:
    def worker(backend):
        params = _params(dtype)
        opt = CONFIGS[config](params, backend)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * backend.rank + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            opt.step()
        opt.flush()
        return _digest(params, opt)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        digests = InProcessBackend.run(workers, worker, timeout_s=120)
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="FILE", help="write the 48 hashes to FILE (refuses to overwrite)")
    mode.add_argument("--against", metavar="FILE", help="compare the 48 hashes with FILE's")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hashes = {
        f"{config}/{workers}w/{name}": run(config, workers, dtype)
        for config in CONFIGS for workers in (1, 3) for name, dtype in DTYPES.items()
    }
    if args.save:
        try:
            with open(args.save, "x") as f:
                json.dump(hashes, f, indent=1)
        except FileExistsError:
            parser.error(f"{args.save} exists: choose another file")
        print(f"{len(hashes)} runs hashed into {args.save}")
        return 0
    try:
        with open(args.against) as f:
            saved = json.load(f)
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read {args.against}: {exc}")
    differ = [k for k in hashes if saved.get(k) != hashes[k]]
    for k in differ:
        print(f"differs: {k}")
    print(f"{len(hashes) - len(differ)} of {len(hashes)} runs bit-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
