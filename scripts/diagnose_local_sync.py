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

import torch

from distro_opt.comm import InProcessBackend
from distro_opt.quant import value_codec
from distro_opt.experiments.arms import build_optimizer, param_part, parse_arms
from distro_opt.experiments.data import load_corpus, val_batches, worker_batch
from distro_opt.experiments.model import build_model
from distro_opt.experiments.presets import get_preset
from distro_opt.experiments.train import _mean_loss, lr_factor


def norm(x) -> float:
    return float(torch.linalg.vector_norm(x))


def cos(a, b) -> float:
    na, nb = norm(a), norm(b)
    return float((a * b).sum()) / (na * nb) if na > 0 and nb > 0 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", default="distro:sync_every=16,topk=12,bits=2", help="one local-step arm (--arms syntax)")
    ap.add_argument("--stop", type=int, default=208, help="last step to run (the lr schedule is still --steps')")
    ap.add_argument("--steps", type=int, default=300, help="run length the lr schedule is made for")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    ap.add_argument("--warmup-steps", type=int, default=30, help="lr warm-up steps")
    ap.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    ap.add_argument("--eval-at", default="50,100,150,200", help="steps at which the anchor is also evaluated")
    ap.add_argument("--out", type=Path, required=True, help="JSON-lines output (a new file; never overwritten)")
    args = ap.parse_args()
    if args.out.exists():
        ap.error(f"{args.out} exists; choose another --out")
    torch.set_num_threads(1)

    preset = dataclasses.replace(
        get_preset("smoke"), batch_size=args.batch_size, steps=args.steps, warmup_steps=args.warmup_steps,
        eval_batches=args.eval_batches, arms=args.arm,
    )
    (arm,) = parse_arms(args.arm)
    corpus = load_corpus(preset.corpus, preset.tokenizer, preset.vocab_size)
    cfg = preset.model_config(corpus.vocab_size)
    init = build_model(cfg, seed=0).state_dict()
    val = val_batches(corpus.val, n_batches=preset.eval_batches, batch_size=preset.eval_batch_size, seq_len=preset.seq_len)
    eval_at = {int(s) for s in args.eval_at.split(",") if s}
    world = preset.workers
    shared: dict = {}  # (sync, rank) -> dict of tensors; threads of one process
    lock = threading.Lock()
    out = args.out.open("w")
    t_start = time.time()

    def loss_of(model):
        return _mean_loss(model, val, "cpu", False)

    def worker(backend):
        rank = backend.rank
        model = build_model(cfg, seed=0)
        model.load_state_dict(init)
        model.train()
        named = list(model.named_parameters())
        kind_of = {id(p): param_part(n, p) for n, p in named}
        opt = build_optimizer(arm, named, preset, backend)
        H = opt.sync_every
        base_lrs = [g["lr"] for g in opt.param_groups]
        rec: dict = {}
        orig_inputs, orig_compress = opt._inputs, opt._compress

        def inputs(entries):
            xs = orig_inputs(entries)
            rec["params"] = [p for _, p in entries]
            rec["pg"] = [x.detach().clone() for x in xs]
            rec["anchor_old"] = [opt.state[p]["anchor"].clone() for _, p in entries]
            rec["delta_old"] = [opt.state[p]["delta"].clone() if "delta" in opt.state[p] else None for _, p in entries]
            if rank == 0:
                rec["replica_loss"] = loss_of(model)  # p holds this worker's replica here
            return xs

        def compress(entries, layout, xs):
            parts, news = orig_compress(entries, layout, xs)
            rows = []  # per member m: (kind, pre, kept-part, sent, residual, delta_old, dct_pg)
            for j, seg in enumerate(layout.segments):
                idx, vbytes = parts[j]
                sent_vals = value_codec(seg.bits).decode(vbytes, seg.num_chunks, seg.k)
                resid = torch.cat([news[m].reshape(-1, seg.chunk_numel) for m in seg.members])
                sent = torch.zeros_like(resid).scatter_(1, idx, sent_vals.to(resid.dtype))
                pre = resid + sent
                kept = torch.zeros_like(pre).scatter_(1, idx, pre.gather(1, idx))
                for m, (a, b) in zip(seg.members, seg.rows):
                    group = entries[m][0]
                    d_old = rec["delta_old"][m]
                    d_old = torch.zeros_like(pre[a:b]) if d_old is None else d_old.reshape(b - a, -1)
                    dct_pg = pre[a:b] - group["compression_decay"] * d_old
                    rows.append((kind_of[id(entries[m][1])], pre[a:b], kept[a:b], sent[a:b], resid[a:b], d_old,
                                 dct_pg, seg.k, m, seg.chunk))
            rec["rows"] = rows
            return parts, news

        opt._inputs, opt._compress = inputs, compress
        sync = 0
        prev_anchor_loss = loss_of(model) if rank == 0 else None
        if rank == 0:
            out.write(json.dumps({"sync": 0, "step": 0, "anchor_loss": prev_anchor_loss}) + "\n")
            out.flush()
        for step in range(1, args.stop + 1):
            factor = lr_factor(step, preset.steps, preset.warmup_steps, preset.min_lr_ratio)
            for g, base in zip(opt.param_groups, base_lrs):
                g["lr"] = base * factor
            x, y = worker_batch(corpus.train, step=step, rank=rank, world_size=world,
                                batch_size=preset.batch_size, seq_len=preset.seq_len, seed=0)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rank == 0 and step in eval_at:
                with opt.synced_parameters():
                    la = loss_of(model)
                out.write(json.dumps({"eval_step": step, "anchor_loss": la}) + "\n")
                out.flush()
            if step % H:
                continue
            sync += 1
            # -- this worker's numbers --------------------------------------------------------------
            tot = {k: 0.0 for k in ("pg", "ef_old", "pre", "kept", "sent", "qerr", "ef_new", "dot_sent_pg",
                                    "dot_ef_pg", "topk_pg")}
            by_kind: dict = {}
            for kind, pre, kept, sent, resid, d_old, dct_pg, k, _m, _c in rec["rows"]:
                tk = dct_pg.abs().topk(min(k, dct_pg.shape[1]), dim=1).values
                vals = {
                    "pg": norm(dct_pg) ** 2, "ef_old": norm(d_old) ** 2, "pre": norm(pre) ** 2,
                    "kept": norm(kept) ** 2, "sent": norm(sent) ** 2, "qerr": norm(kept - sent) ** 2,
                    "ef_new": norm(resid) ** 2, "dot_sent_pg": float((sent * dct_pg).sum()),
                    "dot_ef_pg": float((d_old * dct_pg).sum()), "topk_pg": norm(tk) ** 2,
                }
                for key, v in vals.items():
                    tot[key] += v
                    by_kind.setdefault(kind, {k2: 0.0 for k2 in tot})[key] += v

            def summarize(t):
                r = {k: math.sqrt(t[k]) for k in ("pg", "ef_old", "pre", "kept", "sent", "qerr", "ef_new", "topk_pg")}
                r["cos_sent_pg"] = t["dot_sent_pg"] / (r["sent"] * r["pg"]) if r["sent"] * r["pg"] else float("nan")
                r["cos_ef_pg"] = t["dot_ef_pg"] / (r["ef_old"] * r["pg"]) if r["ef_old"] * r["pg"] else float("nan")
                r["deliv"] = t["dot_sent_pg"] / t["pg"] if t["pg"] else float("nan")
                return r

            mine = summarize(tot)
            with lock:
                shared[(sync, rank)] = {
                    "stats": mine,
                    "pg": torch.cat([g.reshape(-1) for g in rec["pg"]]),
                    "sent_mask": torch.cat([(r[2] != 0).reshape(-1) for r in rec["rows"]]),  # kept positions
                    # DCT-domain, rows order: unquantized kept, quantized sent, top-k of this sync's pg alone
                    "kept": torch.cat([r[2].reshape(-1) for r in rec["rows"]]),
                    "sent": torch.cat([r[3].reshape(-1) for r in rec["rows"]]),
                    "topk_pg": torch.cat([torch.zeros_like(r[6]).scatter_(1, i, r[6].gather(1, i)).reshape(-1)
                                          for r in rec["rows"]
                                          for i in [r[6].abs().topk(min(r[7], r[6].shape[1]), dim=1).indices]]),
                }
            if rank != 0:
                continue
            # -- rank 0: wait for every worker's numbers of this sync (they are written right after
            # the collective, so this is short), then the global ones ------------------------------
            deadline = time.time() + 120
            while time.time() < deadline:
                with lock:
                    if all((sync, r) in shared for r in range(world)):
                        break
                time.sleep(0.01)
            with lock:
                entries_w = [shared.pop((sync, r)) for r in range(world)]
            mean_pg = torch.stack([e["pg"] for e in entries_w]).mean(0)
            anchor_old = torch.cat([a.reshape(-1) for a in rec["anchor_old"]])
            anchor_new = torch.cat([opt.state[p]["anchor"].reshape(-1) for p in rec["params"]])
            move = anchor_old - anchor_new
            masks = torch.stack([e["sent_mask"] for e in entries_w]).float()
            picks, distinct = float(masks.sum()), float((masks.sum(0) > 0).sum())
            anchor_loss = loss_of(model)  # p == anchor right after a sync
            # Counterfactual one-sync steps from the same anchor_old (the run itself is not changed):
            # dense DiLoCo averaging, parts and scalings of the step the anchor actually took.
            kinds = torch.cat([torch.full((p.numel(),), ("embed", "norm", "matrix").index(kind_of[id(p)]))
                               for p in rec["params"]])
            unit = mean_pg / norm(mean_pg)
            aligned = float((move * unit).sum()) * unit
            steps = {
                "dense": mean_pg, "aligned": aligned, "orth": move - aligned,
                "x0.5": 0.5 * move, "x0.25": 0.25 * move,
                "embed_only": move * (kinds == 0), "matrix_only": move * (kinds == 2),
            }
            def to_params(coeffs):
                """Rows-order DCT coefficients -> entries-order flat parameter-space vector."""
                pieces, off = {}, 0
                for r in rec["rows"]:
                    n = r[1].numel()
                    shape = tuple(rec["params"][r[8]].shape)
                    pieces[r[8]] = opt._transform.decode(coeffs[off:off + n].view(r[1].shape), shape, r[9]).reshape(-1)
                    off += n
                return torch.cat([pieces[m] for m in range(len(rec["params"]))])

            def keepers_mean(key, mask_key="sent_mask"):
                tot = torch.stack([e[key] for e in entries_w]).sum(0)
                cnt = torch.stack([e[mask_key] if mask_key != "topk_pg" else e["topk_pg"] != 0
                                   for e in entries_w]).float().sum(0)
                return tot / cnt.clamp_min(1)

            def all_mean(key):
                return torch.stack([e[key] for e in entries_w]).mean(0)

            alt = {
                "A_actual": to_params(keepers_mean("sent")),
                "B_kept_unquantized": to_params(keepers_mean("kept")),
                "C_sent_allmean": to_params(all_mean("sent")),
                "D_kept_allmean": to_params(all_mean("kept")),
                "F_topk_pg_noEF": to_params(keepers_mean("topk_pg", "topk_pg")),
                "G_topk_pg_noEF_allmean": to_params(all_mean("topk_pg")),
            }
            alt_check = norm(alt["A_actual"] - move) / max(norm(move), 1e-12)
            steps.update({k: v for k, v in alt.items() if k != "A_actual"})
            alt_norms = {k: norm(v) for k, v in alt.items()}
            alt_cos = {k: cos(v, mean_pg) for k, v in alt.items()}
            cf = {}
            with torch.no_grad():
                saved = [p.detach().clone() for p in rec["params"]]
                for name, delta in steps.items():
                    off = 0
                    for p in rec["params"]:
                        n = p.numel()
                        p.copy_((anchor_old[off:off + n] - delta[off:off + n]).view_as(p))
                        off += n
                    cf[name] = loss_of(model)
                for p, s in zip(rec["params"], saved):
                    p.copy_(s)
            dense_loss = cf["dense"]
            row = {
                "sync": sync, "step": step, "lr": opt.param_groups[0]["lr"],
                "prev_anchor_loss": prev_anchor_loss, "replica_loss": rec["replica_loss"],
                "dense_loss": dense_loss, "anchor_loss": anchor_loss, "counterfactual": cf, "alt_norms": alt_norms, "alt_cos_meanpg": alt_cos, "alt_check": alt_check,
                "move": norm(move), "mean_pg": norm(mean_pg), "cos_move_meanpg": cos(move, mean_pg),
                "frac_dense": float((move * mean_pg).sum()) / norm(mean_pg) ** 2,
                "overlap": picks / max(distinct, 1.0),
                "workers": {k: sum(e["stats"][k] for e in entries_w) / world for k in entries_w[0]["stats"]},
                "rank0_by_kind": {kind: summarize(t) for kind, t in by_kind.items()},
                "elapsed_s": time.time() - t_start,
            }
            prev_anchor_loss = anchor_loss
            out.write(json.dumps(row) + "\n")
            out.flush()
            w = row["workers"]
            print(f"sync {sync:3d} step {step:4d} anchor {prev_anchor_loss:.3f} replica {rec['replica_loss']:.3f} "
                  f"dense {dense_loss:.3f} | pg {w['pg']:.3f} ef_old {w['ef_old']:.3f} sent {w['sent']:.3f} "
                  f"deliv {w['deliv']:.3f} cos_ef_pg {w['cos_ef_pg']:.2f} | move {row['move']:.3f} "
                  f"meanpg {row['mean_pg']:.3f} frac {row['frac_dense']:.3f} ({row['elapsed_s']:.0f}s)\n    cf "
                  + " ".join(f"{k} {v:.3f}" for k, v in cf.items())
                  + f"\n    norms " + " ".join(f"{k} {v:.2f}/{alt_cos[k]:.2f}" for k, v in alt_norms.items())
                  + f" check {alt_check:.1e}", flush=True)
        return None

    InProcessBackend.run(world, worker, timeout_s=600)
    out.close()


if __name__ == "__main__":
    main()
