"""Why does the local-step mode stall between steps 50 and 150 at >= 5000x? Per-sync diagnostics.

Builds exactly the runner's setup for ONE local-step arm (experiments.train.run_worker's loop: same
corpus, init, per-worker batches, lr schedule, optimizer via experiments.arms.build_optimizer,
in-process workers) and, at every sync, logs one JSON row with:

* anchor_loss        val loss of the anchor after the sync (the synced model the runner evaluates)
* prev_anchor_loss   val loss of the anchor before the sync
* replica_loss       rank 0's local replica just before the sync (after its H inner steps)
* dense_loss         val loss of anchor_old - mean_w(pg_w): what uncompressed DiLoCo averaging would
                     have given from the same anchor and the same local runs
* per worker (means over workers, and rank 0 per parameter kind):
  pg      ||anchor - p||                     (pseudo-gradient)
  ef_old  ||Delta|| before the sync           (error-feedback buffer, DCT domain)
  pre     ||DCT(pg) + decay * Delta||         (what top-k picks from)
  kept    ||top-k of pre||,  sent ||what was sent (after 2-bit)||,  qerr ||kept - sent||
  ef_new  ||Delta|| after the sync
  cos_sent_pg   cos(sent, DCT(pg)),  cos_ef_pg  cos(Delta_old, DCT(pg))
  deliv   <sent, DCT(pg)> / ||pg||^2  (fraction of this sync's own pg that was delivered)
  topk_pg ||top-k of DCT(pg) alone|| / ||pg||
* move   ||anchor_new - anchor_old||, mean_pg ||mean_w pg_w||, cos(move, mean_pg),
  frac_dense = <move, mean_pg> / ||mean_pg||^2, overlap = picks per distinct coefficient.

    python scripts/diagnose_local_sync.py --arm "distro:sync_every=16,topk=12,bits=2" --stop 208 \
        --out runs/diagnose-h16.jsonl

One torch thread, about 5 minutes on one core for 208 steps. The README's "Why the synced model
stalls" and the issue-6 notes quote its output. It reads the optimizer's private state and wraps
its private ``_inputs`` / ``_compress`` per instance, so it may need updating when those change.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from distro_opt.comm import InProcessBackend
from distro_opt.quant import value_codec
from distro_opt.transform import DCTTransform
from distro_opt.experiments.arms import build_optimizer, param_part, parse_arms
from distro_opt.experiments.data import load_corpus, val_batches, worker_batch
from distro_opt.experiments.model import build_model
from distro_opt.experiments.presets import get_preset
from distro_opt.experiments.train import _mean_loss, lr_factor

# Per-worker sums: squared norms, then the two dot products; summarize() takes the square roots.
SUM_KEYS = ("pg", "ef_old", "pre", "kept", "sent", "qerr", "ef_new", "dot_sent_pg", "dot_ef_pg", "topk_pg")
NORM_KEYS = ("pg", "ef_old", "pre", "kept", "sent", "qerr", "ef_new", "topk_pg")


def norm(x) -> float:
    return float(torch.linalg.vector_norm(x))


def cos(a, b) -> float:
    na, nb = norm(a), norm(b)
    return float((a * b).sum()) / (na * nb) if na > 0 and nb > 0 else float("nan")


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", default="distro:sync_every=16,topk=12,bits=2",
                    help="one local-step arm (--arms syntax)")
    ap.add_argument("--stop", type=int, default=208,
                    help="last step to run (the lr schedule is still --steps')")
    ap.add_argument("--steps", type=int, default=300, help="run length the lr schedule is made for")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    ap.add_argument("--warmup-steps", type=int, default=30, help="lr warm-up steps")
    ap.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    ap.add_argument("--eval-at", default="50,100,150,200", help="steps at which the anchor is also evaluated")
    ap.add_argument("--out", type=Path, required=True,
                    help="JSON-lines output (a new file; never overwritten)")
    args = ap.parse_args()
    if args.out.exists():
        ap.error(f"{args.out} exists; choose another --out")
    try:  # before --out is made: a bad arm must not leave a file that blocks the corrected command
        arms = parse_arms(args.arm)
    except ValueError as exc:
        ap.error(str(exc))
    if len(arms) != 1 or arms[0].kind != "distro" or arms[0].options.get("sync_every", 1) < 2:
        ap.error(f"--arm {args.arm!r}: expected one distro arm with sync_every >= 2 (a local-step arm)")
    return args


@dataclasses.dataclass
class Member:
    """One parameter's rows of its segment at a sync: (num_chunks, chunk_numel) DCT coefficients."""
    kind: str  # param_part(): embed / norm / matrix
    index: int  # position in the sync's entries
    chunk: int  # transform chunk size, to decode back to parameter space
    pre: torch.Tensor  # DCT(pg) + decay * Delta_old: what top-k picks from
    kept: torch.Tensor  # top-k of pre, zeros elsewhere
    sent: torch.Tensor  # kept after the value codec
    resid: torch.Tensor  # Delta after the sync
    delta_old: torch.Tensor  # Delta before the sync
    dct_pg: torch.Tensor
    topk_pg: torch.Tensor  # top-k of dct_pg alone, zeros elsewhere
    topk_pg_sq: float  # ||top-k of dct_pg||^2


def segment_members(entries, layout, parts, news, delta_old, kind_of) -> list[Member]:
    """Rebuilds pre / kept / sent per member from what ``_compress`` returned, in segment rows order."""
    members = []
    for seg, (idx, vbytes) in zip(layout.segments, parts):
        sent_vals = value_codec(seg.bits).decode(vbytes, seg.num_chunks, seg.k)
        resid = torch.cat([DCTTransform.chunk_rows(news[m], seg.chunk) for m in seg.members])
        sent = torch.zeros_like(resid).scatter_(1, idx, sent_vals.to(resid.dtype))
        pre = resid + sent  # error feedback kept exactly what was not sent
        kept = torch.zeros_like(pre).scatter_(1, idx, pre.gather(1, idx))
        for m, (a, b) in zip(seg.members, seg.rows):
            d_old = delta_old[m]
            d_old = torch.zeros_like(pre[a:b]) if d_old is None else DCTTransform.chunk_rows(d_old, seg.chunk)
            dct_pg = pre[a:b] - entries[m][0]["compression_decay"] * d_old
            top = dct_pg.abs().topk(min(seg.k, dct_pg.shape[1]), dim=1)
            members.append(Member(
                kind=kind_of[id(entries[m][1])], index=m, chunk=seg.chunk, pre=pre[a:b], kept=kept[a:b],
                sent=sent[a:b], resid=resid[a:b], delta_old=d_old, dct_pg=dct_pg,
                topk_pg=torch.zeros_like(dct_pg).scatter_(1, top.indices, dct_pg.gather(1, top.indices)),
                topk_pg_sq=norm(top.values) ** 2,
            ))
    return members


class SyncRecorder:
    """Records one worker's last sync: its pseudo-gradients, the anchors and error feedback before
    it, and per-member what was picked and sent.

    There is no public hook, so this wraps the optimizer's private ``_inputs`` / ``_compress`` on
    this one instance and reads its private state and ``_transform``; update it when those change.
    """

    def __init__(self, opt, kind_of: dict, replica_loss: Callable[[], float] | None):
        self.opt, self.kind_of, self._replica_loss = opt, kind_of, replica_loss
        self.params, self.pg, self.anchor_old, self.delta_old = [], [], [], []
        self.members: list[Member] = []
        self.replica_loss = None
        self._inputs, self._compress = opt._inputs, opt._compress
        opt._inputs, opt._compress = self._record_inputs, self._record_compress

    def _record_inputs(self, entries):
        xs = self._inputs(entries)
        state = self.opt.state
        self.params = [p for _, p in entries]
        self.pg = [x.detach().clone() for x in xs]
        self.anchor_old = [state[p]["anchor"].clone() for p in self.params]
        self.delta_old = [state[p]["delta"].clone() if "delta" in state[p] else None for p in self.params]
        if self._replica_loss is not None:
            self.replica_loss = self._replica_loss()  # p holds this worker's replica here
        return xs

    def _record_compress(self, entries, layout, xs):
        parts, news = self._compress(entries, layout, xs)
        self.members = segment_members(entries, layout, parts, news, self.delta_old, self.kind_of)
        return parts, news

    def anchor_new(self) -> torch.Tensor:
        return flat(self.opt.state[p]["anchor"] for p in self.params)

    def to_params(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Members-order flat DCT coefficients -> entries-order flat parameter-space vector."""
        pieces, off = {}, 0
        for mem in self.members:
            n, shape = mem.pre.numel(), tuple(self.params[mem.index].shape)
            pieces[mem.index] = self.opt._transform.decode(coeffs[off:off + n].view(mem.pre.shape), shape,
                                                            mem.chunk).reshape(-1)
            off += n
        return torch.cat([pieces[m] for m in range(len(self.params))])


def summed(members: list[Member]) -> tuple[dict, dict]:
    """SUM_KEYS summed over all members, and per parameter kind."""
    tot = {k: 0.0 for k in SUM_KEYS}
    by_kind: dict = {}
    for m in members:
        vals = {
            "pg": norm(m.dct_pg) ** 2, "ef_old": norm(m.delta_old) ** 2, "pre": norm(m.pre) ** 2,
            "kept": norm(m.kept) ** 2, "sent": norm(m.sent) ** 2, "qerr": norm(m.kept - m.sent) ** 2,
            "ef_new": norm(m.resid) ** 2, "dot_sent_pg": float((m.sent * m.dct_pg).sum()),
            "dot_ef_pg": float((m.delta_old * m.dct_pg).sum()), "topk_pg": m.topk_pg_sq,
        }
        for key, v in vals.items():
            tot[key] += v
            by_kind.setdefault(m.kind, {k2: 0.0 for k2 in tot})[key] += v
    return tot, by_kind


def summarize(t: dict) -> dict:
    r = {k: math.sqrt(t[k]) for k in NORM_KEYS}
    r["cos_sent_pg"] = t["dot_sent_pg"] / (r["sent"] * r["pg"]) if r["sent"] * r["pg"] else float("nan")
    r["cos_ef_pg"] = t["dot_ef_pg"] / (r["ef_old"] * r["pg"]) if r["ef_old"] * r["pg"] else float("nan")
    r["deliv"] = t["dot_sent_pg"] / t["pg"] if t["pg"] else float("nan")
    return r


def keepers_mean(payloads: list[dict], key: str, mask_key: str) -> torch.Tensor:
    """Mean over the workers that picked each coefficient (where ``mask_key`` is nonzero)."""
    tot = torch.stack([e[key] for e in payloads]).sum(0)
    cnt = torch.stack([e[mask_key] != 0 for e in payloads]).float().sum(0)
    return tot / cnt.clamp_min(1)


def all_mean(payloads: list[dict], key: str) -> torch.Tensor:
    return torch.stack([e[key] for e in payloads]).mean(0)


class Run:
    """The runner's setup for one arm, shared by the in-process workers, and rank 0's output."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.preset = dataclasses.replace(
            get_preset("smoke"), batch_size=args.batch_size, steps=args.steps, warmup_steps=args.warmup_steps,
            eval_batches=args.eval_batches, arms=args.arm,
        )
        (self.arm,) = parse_arms(args.arm)
        preset = self.preset
        self.corpus = load_corpus(preset.corpus, preset.tokenizer, preset.vocab_size)
        self.cfg = preset.model_config(self.corpus.vocab_size)
        self.init = build_model(self.cfg, seed=0).state_dict()
        self.val = val_batches(self.corpus.val, n_batches=preset.eval_batches,
                               batch_size=preset.eval_batch_size, seq_len=preset.seq_len)
        self.eval_at = {int(s) for s in args.eval_at.split(",") if s}
        self.payloads: dict = {}  # (sync, rank) -> that worker's payload; threads of one process
        self.lock = threading.Lock()
        self.out = args.out.open("w")
        self.t_start = time.time()

    def loss_of(self, model) -> float:
        return _mean_loss(model, self.val, "cpu", False)

    def write(self, row: dict) -> None:
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()

    def gather(self, sync: int) -> list[dict]:
        """Every worker's payload of this sync; they publish right after the collective, so this is short."""
        world, deadline = self.preset.workers, time.time() + 120
        while time.time() < deadline:
            with self.lock:
                if all((sync, r) in self.payloads for r in range(world)):
                    break
            time.sleep(0.01)
        with self.lock:
            return [self.payloads.pop((sync, r)) for r in range(world)]


def sync_row(run: Run, model, rec: SyncRecorder, payloads, by_kind, sync, step, prev_anchor_loss) -> dict:
    """Rank 0's row of one sync: the workers' means and the counterfactual one-sync steps."""
    mean_pg = all_mean(payloads, "pg")
    anchor_old = flat(rec.anchor_old)
    move = anchor_old - rec.anchor_new()
    masks = torch.stack([e["kept"] != 0 for e in payloads]).float()
    picks, distinct = float(masks.sum()), float((masks.sum(0) > 0).sum())
    anchor_loss = run.loss_of(model)  # p == anchor right after a sync
    # Counterfactual one-sync steps from the same anchor_old (the run itself is not changed):
    # dense DiLoCo averaging, parts and scalings of the step the anchor actually took.
    kinds = torch.cat([torch.full((p.numel(),), ("embed", "norm", "matrix").index(rec.kind_of[id(p)]))
                       for p in rec.params])
    unit = mean_pg / norm(mean_pg)
    aligned = float((move * unit).sum()) * unit
    steps = {
        "dense": mean_pg, "aligned": aligned, "orth": move - aligned,
        "x0.5": 0.5 * move, "x0.25": 0.25 * move,
        "embed_only": move * (kinds == 0), "matrix_only": move * (kinds == 2),
    }
    alt = {
        "A_actual": rec.to_params(keepers_mean(payloads, "sent", "kept")),
        "B_kept_unquantized": rec.to_params(keepers_mean(payloads, "kept", "kept")),
        "C_sent_allmean": rec.to_params(all_mean(payloads, "sent")),
        "D_kept_allmean": rec.to_params(all_mean(payloads, "kept")),
        "F_topk_pg_noEF": rec.to_params(keepers_mean(payloads, "topk_pg", "topk_pg")),
        "G_topk_pg_noEF_allmean": rec.to_params(all_mean(payloads, "topk_pg")),
    }
    alt_check = norm(alt["A_actual"] - move) / max(norm(move), 1e-12)
    steps.update({k: v for k, v in alt.items() if k != "A_actual"})
    cf = {}
    with torch.no_grad():
        saved = [p.detach().clone() for p in rec.params]
        for name, delta in steps.items():
            off = 0
            for p in rec.params:
                n = p.numel()
                p.copy_((anchor_old[off:off + n] - delta[off:off + n]).view_as(p))
                off += n
            cf[name] = run.loss_of(model)
        for p, s in zip(rec.params, saved):
            p.copy_(s)
    return {
        "sync": sync, "step": step, "lr": rec.opt.param_groups[0]["lr"],
        "prev_anchor_loss": prev_anchor_loss, "replica_loss": rec.replica_loss,
        "dense_loss": cf["dense"], "anchor_loss": anchor_loss, "counterfactual": cf,
        "alt_norms": {k: norm(v) for k, v in alt.items()},
        "alt_cos_meanpg": {k: cos(v, mean_pg) for k, v in alt.items()}, "alt_check": alt_check,
        "move": norm(move), "mean_pg": norm(mean_pg), "cos_move_meanpg": cos(move, mean_pg),
        "frac_dense": float((move * mean_pg).sum()) / norm(mean_pg) ** 2,
        "overlap": picks / max(distinct, 1.0),
        "workers": {k: sum(e["stats"][k] for e in payloads) / len(payloads) for k in payloads[0]["stats"]},
        "rank0_by_kind": {kind: summarize(t) for kind, t in by_kind.items()},
        "elapsed_s": time.time() - run.t_start,
    }


def print_row(row: dict) -> None:
    w, cf, alt_cos = row["workers"], row["counterfactual"], row["alt_cos_meanpg"]
    print(f"sync {row['sync']:3d} step {row['step']:4d} anchor {row['anchor_loss']:.3f} "
          f"replica {row['replica_loss']:.3f} dense {row['dense_loss']:.3f} | pg {w['pg']:.3f} "
          f"ef_old {w['ef_old']:.3f} sent {w['sent']:.3f} deliv {w['deliv']:.3f} "
          f"cos_ef_pg {w['cos_ef_pg']:.2f} | move {row['move']:.3f} meanpg {row['mean_pg']:.3f} "
          f"frac {row['frac_dense']:.3f} "
          f"({row['elapsed_s']:.0f}s)\n    cf " + " ".join(f"{k} {v:.3f}" for k, v in cf.items())
          + "\n    norms " + " ".join(f"{k} {v:.2f}/{alt_cos[k]:.2f}" for k, v in row["alt_norms"].items())
          + f" check {row['alt_check']:.1e}", flush=True)


def run_worker(run: Run, backend) -> None:
    """experiments.train.run_worker's loop, with a row per sync from rank 0."""
    rank, preset = backend.rank, run.preset
    model = build_model(run.cfg, seed=0)
    model.load_state_dict(run.init)
    model.train()
    named = list(model.named_parameters())
    opt = build_optimizer(run.arm, named, preset, backend)
    base_lrs = [g["lr"] for g in opt.param_groups]
    rec = SyncRecorder(opt, {id(p): param_part(n, p) for n, p in named},
                       (lambda: run.loss_of(model)) if rank == 0 else None)
    sync = 0
    prev_anchor_loss = run.loss_of(model) if rank == 0 else None
    if rank == 0:
        run.write({"sync": 0, "step": 0, "anchor_loss": prev_anchor_loss})
    for step in range(1, run.args.stop + 1):
        factor = lr_factor(step, preset.steps, preset.warmup_steps, preset.min_lr_ratio)
        for g, base in zip(opt.param_groups, base_lrs):
            g["lr"] = base * factor
        x, y = worker_batch(run.corpus.train, step=step, rank=rank, world_size=preset.workers,
                            batch_size=preset.batch_size, seq_len=preset.seq_len, seed=0)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and step in run.eval_at:
            with opt.synced_parameters():
                anchor_loss = run.loss_of(model)
            run.write({"eval_step": step, "anchor_loss": anchor_loss})
        if step % opt.sync_every:
            continue
        sync += 1
        tot, by_kind = summed(rec.members)
        with run.lock:
            run.payloads[(sync, rank)] = {  # DCT-domain tensors in members order
                "stats": summarize(tot), "pg": flat(rec.pg),
                "kept": flat(m.kept for m in rec.members),  # unquantized: its nonzeros are the picks
                "sent": flat(m.sent for m in rec.members),
                "topk_pg": flat(m.topk_pg for m in rec.members),  # this sync's pg alone, no error feedback
            }
        if rank == 0:
            row = sync_row(run, model, rec, run.gather(sync), by_kind, sync, step, prev_anchor_loss)
            prev_anchor_loss = row["anchor_loss"]
            run.write(row)
            print_row(row)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    run = Run(args)
    with run.out:
        InProcessBackend.run(run.preset.workers, lambda backend: run_worker(run, backend), timeout_s=600)


if __name__ == "__main__":
    main()
