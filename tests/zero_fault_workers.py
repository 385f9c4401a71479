"""What tests/test_zero_faults.py runs on each rank: a re-save that fails part-way, a checkpoint
of one optimizer loaded into another, and a ZeRO-2 parameter that gets a gradient on one rank
only. Spawned ranks import this module: the tests put ``tests/`` on ``sys.path``, as pytest does."""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.zero import CheckpointError, ShardedGradOptimizer, ShardedOptimizer, load_sharded, save_sharded
from zero_workers import ToyNet, _toy_batch

__all__ = ["BranchNet", "fault_rank"]


class BranchNet(ToyNet):
    """ToyNet with a branch that only rank 0 runs: its parameters get a gradient there only."""

    def __init__(self):
        super().__init__()
        self.branch = nn.Linear(3, 3)  # 12 numbers

    def forward(self, idx, targets, use_branch=False):
        loss = super().forward(idx, targets)
        if use_branch:
            loss = loss + self.branch(self.emb(idx)).square().mean()
        return loss


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _failed_resave(rank, world_size, folder):
    """Save a good checkpoint, then re-save into its folder with rank 1 failing mid-way."""
    torch.manual_seed(0)
    model = ToyNet()
    opt = ShardedOptimizer(model.named_parameters(), torch.optim.AdamW, bucket_numel=16, lr=0.05)
    model(*_toy_batch(0, rank, world_size)).backward()
    opt.step()
    save_sharded(folder, opt, opt, extra={"step": 1})
    before = _digests(folder)
    model(*_toy_batch(1, rank, world_size)).backward()
    opt.step()
    extra = {"step": 2, "why": (lambda: 0) if rank == 1 else None}  # a lambda cannot be pickled
    try:
        save_sharded(folder, opt, opt, extra=extra)
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"error": error, "unchanged": _digests(folder) == before,
            "leftovers": sorted(p.name for p in folder.parent.iterdir() if p.name.startswith("."))}


def _adamw_into_sgd(rank, world_size, folder):
    torch.manual_seed(0)
    model = ToyNet()
    opt = ShardedOptimizer(model.named_parameters(), torch.optim.SGD, bucket_numel=16, lr=0.5)
    try:
        load_sharded(folder, opt, opt)
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"error": error, "lr": opt.param_groups[0]["lr"], "inner_lr": opt.inner.param_groups[0]["lr"]}


def _branch_on_rank0(rank, world_size, wrap, steps=3):
    """BranchNet in float64 with SGD, the branch used on rank 0 only: final parameters."""
    torch.manual_seed(0)
    model = BranchNet().double()
    if wrap == "zero2":
        net, opt = model, ShardedGradOptimizer(model.named_parameters(), torch.optim.SGD, bucket_numel=16, lr=0.1)
    else:
        net = DDP(model, find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        net(*_toy_batch(step, rank, world_size), use_branch=rank == 0).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}  # stage 2 gathers them all


def fault_rank(rank, world_size, folder):
    torch.set_num_threads(1)
    out = {"resave": _failed_resave(rank, world_size, folder)}
    out["sgd"] = _adamw_into_sgd(rank, world_size, folder)
    out["branch"] = {wrap: _branch_on_rank0(rank, world_size, wrap) for wrap in ("zero2", "ddp_torch")}
    return out
