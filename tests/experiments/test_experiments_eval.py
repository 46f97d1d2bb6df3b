"""The runner's evaluation: in the local-step mode it scores the synced model, not rank 0's replica."""
import copy

import torch

from distro_opt import DisTrOAdamW
from distro_opt.experiments.model import build_model
from distro_opt.experiments.presets import get_preset
from distro_opt.experiments.train import evaluate


def test_local_step_evaluation_scores_the_anchor_and_leaves_the_replica_as_it_was():
    model = build_model(get_preset("smoke").model_config(256), seed=0)
    opt = DisTrOAdamW(model.parameters(), lr=1e-2, sync_every=4, compression_topk=8, compression_bits=2)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen))]
    for t in range(6):  # one sync (step 4), then two local steps
        x = torch.randint(0, 256, (4, 16), generator=gen)
        opt.zero_grad()
        model(x, x).backward()
        opt.step()
        if t == 3:
            synced = copy.deepcopy(model)
    replica = {k: v.clone() for k, v in model.state_dict().items()}

    got = evaluate(model, batches, "cpu", False, opt)

    assert got == evaluate(synced, batches, "cpu", False)
    assert got != evaluate(model, batches, "cpu", False)  # the replica, after two local steps, differs
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in replica.items())
