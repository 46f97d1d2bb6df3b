"""One rank of a multi-process test: ``python tests/_dist_worker.py OUTDIR JOBS``.

JOBS is a JSON list of ``[name, scenario, args]``, run in order in one process group.

The launcher (tests/comm/test_torch_backend.py) sets RANK, WORLD_SIZE and DISTRO_OPT_RENDEZVOUS_FILE:
the ranks meet through a file (experiments.process_group), and Gloo's own sockets are on 127.0.0.1
(GLOO_SOCKET_IFNAME=lo). Each scenario returns a dict; they are saved to OUTDIR/rank{RANK}.pt for
the test to check, as ``{name: result}``; an unexpected exception is saved there too
(``error_type``, ``error``) and exits with 3.
Run by path, so the repository root is not on sys.path (``comm`` must not be importable top-level).
"""
from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from distro_opt.comm import resolve_backend
from distro_opt.comm.torch_backend import CollectiveError, TorchDistributedBackend
from distro_opt.experiments.process_group import end_process, start_process_group

GROUP_TIMEOUT_S = 60


def pattern(nbytes: int, rank: int, call: int) -> torch.Tensor:
    """A buffer whose bytes tell who sent it and in which call."""
    return ((torch.arange(nbytes) * (rank + 3) + call * 7 + rank) % 256).to(torch.uint8)


def outcome(fn) -> dict:
    try:
        return {"ok": fn()}
    except (ValueError, CollectiveError) as exc:
        return {"error_type": type(exc).__name__, "error": str(exc),
                "is_value_error": isinstance(exc, ValueError)}


def scenario_raw(rank, world_size, args):
    backend = TorchDistributedBackend()
    res = {"rank": backend.rank, "world_size": backend.world_size}
    res["gather"] = [b.tolist() for b in backend.all_gather(pattern(5, rank, 0))]
    first = backend.start_all_gather(pattern(5, rank, 1))
    second = backend.start_all_gather(pattern(5, rank, 2))  # two in flight at once
    res["async"] = [[b.tolist() for b in p.wait()] for p in (first, second)]
    res["mean"] = backend.all_reduce(torch.tensor([float(rank + 1), 2.0 * rank]), "mean").tolist()
    res["sum"] = backend.all_reduce(torch.tensor([float(rank + 1)]), "sum").tolist()
    res["bytes_sent"], res["steps"] = backend.stats.bytes_sent, backend.stats.steps
    resolved = [resolve_backend(), resolve_backend(process_group=dist.group.WORLD)]
    res["resolved"] = [type(b).__name__ for b in resolved]
    # A sub-group of ranks 0 and 1 (every rank must call new_group, members or not).
    sub = dist.new_group([0, 1])
    if rank < 2:
        sub_backend = TorchDistributedBackend(group=sub)
        res["sub"] = [b.tolist() for b in sub_backend.all_gather(pattern(3, rank, 9))]
    else:
        res["sub"] = outcome(lambda: TorchDistributedBackend(group=sub))
    return res


def scenario_sizes(rank, world_size, args):
    """Buffer sizes that differ (first call, later call) or change together (agreed resize)."""
    backend = TorchDistributedBackend(timeout_s=20)
    sizes = [10 + rank, 16, 17 if rank == 1 else 16, 20, 20]
    calls = [outcome(lambda: [b.tolist() for b in backend.all_gather(pattern(n, rank, i))])
             for i, n in enumerate(sizes)]
    return {"sizes": sizes, "calls": calls, "bytes_sent": backend.stats.bytes_sent}


def read_wchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


def scenario_wchar(rank, world_size, args):
    nbytes, calls = int(args[0]), int(args[1])
    backend = TorchDistributedBackend(timeout_s=30)
    buf = pattern(nbytes, rank, 0)
    backend.all_gather(buf)  # the size agreement happens here, outside the measurement
    sent0, w0 = backend.stats.bytes_sent, read_wchar()
    for _ in range(calls):
        backend.all_gather(buf)
    wchar, sent = read_wchar() - w0, backend.stats.bytes_sent - sent0
    # The same measurement with no collective: what the process writes on its own (noise floor).
    w1 = read_wchar()
    time.sleep(0.2)
    return {"wchar": wchar, "bytes_sent": sent, "idle_wchar": read_wchar() - w1}


def scenario_dead_peer(rank, world_size, args):
    """Rank 1 is killed (SIGKILL) or hangs after two all-gathers; rank 0 times its failure in the
    collective named by args[2] (``gather`` or ``barrier``). args[0]: the backend's timeout_s, or
    ``group:S`` for none (timeout_s=None) on a group of all ranks whose own timeout is S seconds."""
    if args[0].startswith("group:"):
        timeout = datetime.timedelta(seconds=float(args[0][len("group:"):]))
        backend = TorchDistributedBackend(group=dist.new_group(list(range(world_size)), timeout=timeout))
    else:
        backend = TorchDistributedBackend(timeout_s=float(args[0]))
    for i in range(2):
        backend.all_gather(pattern(64, rank, i))
    if rank == 1:
        if args[1] == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        parent, give_up = os.getppid(), time.monotonic() + 120
        while os.getppid() == parent and time.monotonic() < give_up:  # hung until the launcher kills
            time.sleep(0.2)  # it; never outlives a launcher that died itself
        os._exit(4)
    collective = {"gather": lambda: len(backend.all_gather(pattern(64, rank, 2))), "barrier": backend.barrier}
    t0 = time.monotonic()
    res = outcome(collective[args[2]])
    res["elapsed_s"] = time.monotonic() - t0
    return res


def scenario_killed(rank, world_size, args):
    """Every rank is killed (SIGKILL) after one all-gather: the job leaves its rendezvous file."""
    TorchDistributedBackend(timeout_s=20).all_gather(pattern(8, rank, 0))
    os.kill(os.getpid(), signal.SIGKILL)


def scenario_train(rank, world_size, args):
    """Train with DisTrOAdamW over Gloo (with --shard-degree, a hybrid run, wired as the script wires
    it); the test compares with the in-process simulation, or another run."""
    from distro_opt.experiments.train_ddp import TrainConfig, optimizer_group, train

    cfg = TrainConfig.from_args(args)
    hybrid, replicas = optimizer_group(cfg, TorchDistributedBackend(timeout_s=30))
    return train(cfg, replicas, hybrid=hybrid)


def scenario_mismatch(rank, world_size, args):
    """Rank 1's model differs: first in payload size (hidden 32), then only in layout (hidden 60);
    then the models agree and rank 1's learning rate differs ("settings")."""
    from distro_opt.experiments.train_ddp import TrainConfig, train

    calls = {}
    for name, hidden in (("size", 32), ("layout", 60)):
        cfg = TrainConfig(steps=1, hidden=hidden if rank == 1 else 64, log=False)
        calls[name] = outcome(lambda: train(cfg, TorchDistributedBackend(timeout_s=20))["losses"])
    cfg = TrainConfig(steps=1, lr=0.02 if rank == 1 else 0.01, log=False)
    calls["settings"] = outcome(lambda: train(cfg, TorchDistributedBackend(timeout_s=20))["losses"])
    return calls


def scenario_cuda_raw(rank, world_size, args):
    """The NCCL path: CUDA buffers in, CUDA buffers out, same bytes and accounting."""
    backend = TorchDistributedBackend(timeout_s=60)
    device = torch.device("cuda", torch.cuda.current_device())
    gathered = backend.all_gather(pattern(5, rank, 0).to(device))
    pending = backend.start_all_gather(pattern(7, rank, 1).to(device))
    reduced = backend.all_reduce(torch.full((3,), float(rank + 1), device=device), "mean")
    return {
        "devices": sorted({b.device.type for b in gathered}),
        "gather": [b.tolist() for b in gathered],
        "async": [b.tolist() for b in pending.wait()],
        "mean": reduced.tolist(),
    }


# -- FSDP2 / DTensor: a 2 x 2 mesh, sharded within a row, distro-opt across rows ---------------------
FSDP_DIMS = (128, 256, 128)  # every local shard's rows a multiple of 64: the chunks match the unsharded run


def _fsdp_model():
    torch.manual_seed(0)
    a, b, c = FSDP_DIMS
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh(), torch.nn.Linear(b, c))


def _replica_batch(step, replica):
    """The batch of data-parallel replica ``replica`` at ``step`` (8 rows): the same in both runs."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(8, FSDP_DIMS[0], generator=g)
    return x, torch.tanh(x.flip(1))


def _optimizer(params, comm, args):
    from distro_opt import DisTrOAdamW

    sync_every = int(args[1]) if len(args) > 1 else 1
    return DisTrOAdamW(params, lr=0.01, comm=comm, sync_every=sync_every, compression_topk=8, compression_chunk=64)


def _fsdp_setup(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _fsdp_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    replica, shard = mesh.get_coordinate()
    return model, _optimizer(model.parameters(), mesh["replicate"].get_group(), args), replica, shard


def _fsdp_train(model, opt, replica, shard, steps, first=0):
    losses = []
    for t in range(first, first + steps):
        x, y = _replica_batch(t, replica)
        rows = slice(4 * shard, 4 * shard + 4)  # this shard rank's half of its replica's batch
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full(model):
    from distro_opt.shards import is_sharded

    with torch.no_grad():
        return [(p.full_tensor() if is_sharded(p) else p).detach().clone() for p in model.parameters()]


def scenario_fsdp_hybrid(rank, world_size, args):
    """FSDP2 over the mesh's shard dimension, DisTrOAdamW over its replicate dimension."""
    model, opt, replica, shard = _fsdp_setup(args)
    losses = _fsdp_train(model, opt, replica, shard, int(args[0]))
    return {
        "replica": replica, "shard": shard, "losses": losses, "full": _full(model),
        "local": [p.to_local().detach().clone() for p in model.parameters()],
        "local_shapes": [tuple(p.to_local().shape) for p in model.parameters()],
        "payload_nbytes": opt.payload_nbytes, "bytes_sent": opt.comm.stats.bytes_sent,
        "steps": opt.comm.stats.steps, "world_size": opt.comm.world_size,
        "checks": opt.replica_check_stats.steps, "check_sent": opt.replica_check_stats.bytes_sent,
        "state_types": sorted({type(v).__name__ for st in opt.state.values() if isinstance(st, dict)
                               for v in st.values()}),
    }


def scenario_plain_replicas(rank, world_size, args):
    """The unsharded reference: one process per replica, each on its replica's whole batch."""
    model = _fsdp_model()
    opt = _optimizer(model.parameters(), None, args)
    losses = []
    for t in range(int(args[0])):
        x, y = _replica_batch(t, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "full": _full(model), "payload_nbytes": opt.payload_nbytes}


def scenario_fsdp_resume(rank, world_size, args):
    """Train, save each rank's model and optimizer state_dict (DTensors), train on; a fresh sharded
    model and optimizer loaded from them must take the same steps bit for bit."""
    path = os.path.join(args[2], f"rank{rank}.ckpt")
    model, opt, replica, shard = _fsdp_setup(args)
    _fsdp_train(model, opt, replica, shard, 3)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    _fsdp_train(model, opt, replica, shard, 3, first=3)
    continued = _full(model)
    fresh, fresh_opt, _, _ = _fsdp_setup(args)
    saved = torch.load(path, weights_only=False)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["optim"])
    _fsdp_train(fresh, fresh_opt, replica, shard, 3, first=3)
    return {"continued": continued, "resumed": _full(fresh),
            "delta_types": sorted({type(st["delta"]).__name__ for st in fresh_opt.state.values()
                                   if isinstance(st, dict) and "delta" in st})}


def scenario_fsdp_dcp(rank, world_size, args):
    """As ``fsdp_resume``, through torch.distributed.checkpoint (the runner's and train_ddp's
    ``sharded_checkpoint`` helpers): one checkpoint for all ranks."""
    from distro_opt.experiments.sharded_checkpoint import load_sharded, save_sharded

    path, saved_at = os.path.join(args[2], "dcp"), int(args[3])
    model, opt, replica, shard = _fsdp_setup(args)
    _fsdp_train(model, opt, replica, shard, saved_at)
    save_sharded(path, model, opt)
    _fsdp_train(model, opt, replica, shard, 3, first=saved_at)
    continued = _full(model)
    fresh, fresh_opt, _, _ = _fsdp_setup(args)
    load_sharded(path, fresh, fresh_opt)
    _fsdp_train(fresh, fresh_opt, replica, shard, 3, first=saved_at)
    return {"continued": continued, "resumed": _full(fresh)}


def scenario_fsdp_uneven(rank, world_size, args):
    """A parameter of 129 rows sharded over 2 ranks: shards of 65 and 64 rows. Over the replicate
    group (same shards) it trains; over the shard group (different shards) every rank must refuse
    the step with the payload-mismatch error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distro_opt import DisTrOAdamW

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 129)
    fully_shard(model, mesh=mesh["shard"])
    opt = DisTrOAdamW(model.parameters(), lr=0.01, comm=mesh[args[0]].get_group())
    replica, _ = mesh.get_coordinate()

    def train():
        x, _ = _replica_batch(0, replica)
        model(x).pow(2).mean().backward()
        opt.step()
        return [tuple(p.to_local().shape) for p in model.parameters()]

    return outcome(train)


SCENARIOS = {
    "cuda_raw": scenario_cuda_raw,
    "mismatch": scenario_mismatch,
    "raw": scenario_raw,
    "sizes": scenario_sizes,
    "wchar": scenario_wchar,
    "dead_peer": scenario_dead_peer,
    "killed": scenario_killed,
    "train": scenario_train,
    "fsdp_hybrid": scenario_fsdp_hybrid,
    "plain_replicas": scenario_plain_replicas,
    "fsdp_resume": scenario_fsdp_resume,
    "fsdp_dcp": scenario_fsdp_dcp,
    "fsdp_uneven": scenario_fsdp_uneven,
}


def main() -> None:
    faulthandler.enable()  # a crash in torch's C++ (SIGABRT, SIGSEGV) puts the Python stack in the log
    outdir, jobs = sys.argv[1], json.loads(sys.argv[2])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    backend = os.environ.get("TEST_DIST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        start_process_group(backend, datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    except RuntimeError as exc:  # saved as the result of a job named "start", for the test to check
        torch.save({"start": {"error_type": type(exc).__name__, "error": str(exc)}}, path)
        os._exit(3)
    results = {}
    for name, scenario, args in jobs:  # one process group serves several jobs: fewer slow launches
        try:
            results[name] = SCENARIOS[scenario](rank, world_size, [str(a) for a in args])
        except Exception as exc:  # saved for the test to show; the group may be broken: exit at once
            results[name] = {"error_type": type(exc).__name__, "error": str(exc)}
            torch.save(results, path)
            print(f"rank {rank}, job {name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            os._exit(3)
        if results[name].get("error_type") == "CollectiveError":
            torch.save(results, path)
            os._exit(0)  # the group is broken: destroy_process_group could wait forever on the dead peer
    torch.save(results, path)
    # Everything the tests check is saved: end the group and skip the interpreter's finalization,
    # where a Gloo rank can abort (end_process).
    end_process(0, None, destroy_group=True)


if __name__ == "__main__":
    main()
