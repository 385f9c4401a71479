"""ToyNet: a model of 82 numbers with every case that sharding has to get right.

Parameter tensors of uneven sizes, a 3-element unit (fewer elements than ranks), an output layer
tied to the embedding and used by another unit, a frozen layer and a layer that is never called.
``toy_rank`` trains it under stages 1-3 (or in one process, ``"single"``) for the tests.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .stage1 import ShardedOptimizer
from .stage2 import ShardedGradOptimizer
from .stage3 import FullyShardedModule

__all__ = ["Gain", "ToyNet", "toy_build", "toy_rank"]


class Gain(nn.Module):
    """x * g with a learned gain vector g (d,): a unit smaller than most world sizes."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight


class ToyNet(nn.Module):
    """Uneven parameter sizes, a 3-element unit, an output layer tied to the embedding and used
    by another unit, a frozen layer and a layer that is never called."""

    def __init__(self, vocab_size=7, d_model=3, hidden=5):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_model)  # 21 elements, tied to head
        self.fc1 = nn.Linear(d_model, hidden)  # 20
        self.fc2 = nn.Linear(hidden, d_model)  # 18
        self.gain = Gain(d_model)  # 3
        self.frozen = nn.Linear(d_model, d_model).requires_grad_(False)  # 12, never trained
        self.unused = nn.Linear(d_model, 2)  # 8, never called: its gradients stay None
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, targets):
        h = self.emb(idx)  # (B, T, d)
        h = h + self.fc2(torch.tanh(self.fc1(h)))  # (B, T, d)
        logits = self.head(self.frozen(self.gain(h)))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _batch(step, rank, world_size, global_batch=8, seq_len=4, seed=0):
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randint(7, (global_batch, seq_len), generator=gen)  # (B, T)
    y = torch.randint(7, (global_batch, seq_len), generator=gen)  # (B, T)
    b = global_batch // world_size
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


def toy_build(kind):
    """(net, optimizer, full state dict fn) of ToyNet under ``kind``: single, zero1, zero2 or zero3."""
    torch.manual_seed(0)
    model = ToyNet()
    kw = {"lr": 0.05, "weight_decay": 0.1}
    if kind == "single":
        return model, torch.optim.AdamW(model.parameters(), **kw), model.state_dict
    if kind in ("zero1", "zero2"):
        cls = ShardedOptimizer if kind == "zero1" else ShardedGradOptimizer
        return model, cls(model.parameters(), torch.optim.AdamW, bucket_numel=16, **kw), model.state_dict
    net = FullyShardedModule(model, unit_types=(nn.Linear, Gain))
    return net, torch.optim.AdamW(net.parameters(), **kw), net.full_state_dict


def toy_rank(rank, world_size, kinds=("zero1", "zero2", "zero3"), steps=3):
    """Train :class:`ToyNet` under each kind (or ``"single"`` in one process); losses and params."""
    torch.set_num_threads(1)
    out = {}
    for kind in kinds:
        net, opt, full_state = toy_build(kind)
        losses = []
        for step in range(steps):
            loss = net(*_batch(step, rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out[kind] = {"losses": losses, "params": {k: v.detach().numpy().copy() for k, v in full_state().items()}}
    return out
