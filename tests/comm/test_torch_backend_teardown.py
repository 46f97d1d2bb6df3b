"""TorchDistributedBackend and the end of a job: the process group is the caller's, and the backend
must not keep it alive after ``destroy_process_group`` (a group freed later, at interpreter exit,
is where Gloo's teardown can abort the process with "terminate called without an active
exception"). Run in a child process: one rank, a FileStore, a bounded wait."""
import json
import subprocess
import sys

CHILD = r"""
import gc, json, sys, weakref
import torch, torch.distributed as dist
from distro_opt.comm import TorchDistributedBackend
from distro_opt.comm.torch_backend import CollectiveError

dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
group = dist.new_group([0])
backend = TorchDistributedBackend(group, timeout_s=30)
gathered = backend.all_gather(torch.arange(3, dtype=torch.uint8))
alive = weakref.ref(group)
del group
dist.destroy_process_group()
gc.collect()
try:
    backend.all_gather(torch.arange(3, dtype=torch.uint8))
    after = "no error"
except CollectiveError as exc:
    after = str(exc)
print(json.dumps({"gathered": [t.tolist() for t in gathered], "group_freed": alive() is None, "after": after}))
"""


def test_a_destroyed_group_is_freed_at_once_and_the_backend_says_it_is_gone(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["gathered"] == [[0, 1, 2]]
    assert result["group_freed"]  # the backend held no reference that outlived destroy_process_group
    assert "the process group was destroyed" in result["after"]
