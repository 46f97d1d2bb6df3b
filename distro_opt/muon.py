"""``MuonAdamW``: Muon on the hidden matrices, AdamW on the rest, as one torch optimizer; the inner
optimizer of MuLoCo (DiLoCo with Muon as the inner optimizer, 2025).

Muon (Jordan et al. 2024) orthogonalizes each 2-D parameter's Nesterov momentum by a few
Newton-Schulz iterations and steps along it: ``B = mu B + g``, ``O = NS(g + mu B)``,
``p *= 1 - lr * wd``, ``p -= a * lr * O``. With ``adjust_lr_fn="match_rms_adamw"`` (the default here) the step's
scale ``a = 0.2 * sqrt(max(rows, cols))`` gives it AdamW's update RMS (Liu et al. 2025, Moonlight),
so AdamW's lr and weight decay carry over. Embeddings, output heads and 1-D parameters take AdamW.

The steps are torch's own ``torch.optim.Muon`` and ``torch.optim.AdamW``, each over its share of the
groups. This class holds the groups in the order given (one per group of the outer optimizer, as the
local-step mode needs) and one ``state`` for both, so that ``state_dict()`` and ``load_state_dict()``
are torch's, position for position::

    DisTrOAdamW(groups, sync_every=16, inner_optimizer=lambda gs: MuonAdamW(gs, muon_groups=[1]))
"""
from __future__ import annotations

import torch

# Muon's settings beside AdamW's; momentum and nesterov are the Muon paper's
MUON_DEFAULTS = dict(momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the groups ``muon_groups`` names (indices into ``params``' groups;
    default: every group whose parameters are all 2-D), ``torch.optim.AdamW`` on the others.

    A Muon group must hold 2-D parameters only (torch's Muon refuses others); put embeddings and
    output heads in AdamW groups: Muon is meant for hidden matrices. Keyword arguments are the
    defaults of the groups that lack them: ``lr``, ``betas``, ``eps`` and ``weight_decay`` for both
    kinds (Muon uses no betas; its ``eps`` guards the Newton-Schulz normalization), and Muon's
    ``momentum``, ``nesterov``, ``ns_steps``, ``adjust_lr_fn``."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, muon_groups=None, **muon_settings):
        unknown = set(muon_settings) - set(MUON_DEFAULTS)
        if unknown:
            raise TypeError(f"MuonAdamW got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if muon_groups is None:
            muon_groups = [i for i, g in enumerate(self.param_groups) if all(p.dim() == 2 for p in g["params"])]
        muon_groups = sorted(set(muon_groups))
        if any(not (isinstance(i, int) and 0 <= i < len(self.param_groups)) for i in muon_groups):
            raise ValueError(f"Invalid muon_groups: {muon_groups} (indices of the {len(self.param_groups)} groups)")
        for i in muon_groups:
            shapes = [tuple(p.shape) for p in self.param_groups[i]["params"] if p.dim() != 2]
            if shapes:
                raise ValueError(f"group {i} takes Muon, which steps 2-D parameters only; it holds shapes {shapes}")
        self._muon_groups = muon_groups
        self._muon_settings = {**MUON_DEFAULTS, **muon_settings}
        self._children = self._make_children()

    def _make_children(self):
        """Muon and AdamW over this optimizer's own group dicts, writing into this optimizer's state."""
        kinds = [(torch.optim.Muon, self._muon_groups, self._muon_settings),
                 (torch.optim.AdamW, [i for i in range(len(self.param_groups)) if i not in self._muon_groups], {})]
        children = []
        for cls, indices, settings in kinds:
            if indices:
                child = cls([self.param_groups[i] for i in indices], **settings)
                child.state = self.state  # one state, keyed by parameter: the kinds' parameters are apart
                children.append(child)
        return children

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for child in self._children:
            child.step()
        return loss

    def add_param_group(self, param_group) -> None:
        """As torch's; a group added after construction takes AdamW (Muon's groups are named at
        construction)."""
        super().add_param_group(param_group)
        if getattr(self, "_children", None) is not None:
            self._children = self._make_children()

    def load_state_dict(self, state_dict) -> None:
        """As torch's; torch makes new group dicts and a new state, which the two steps then use."""
        super().load_state_dict(state_dict)
        self._children = self._make_children()
