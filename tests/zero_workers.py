"""What the ZeRO tests run on each rank, beyond the lab's ``labkit.runs.zero.train_rank``.

ToyNet: a model of 82 numbers with every case that sharding has to get right: parameter
tensors of uneven sizes, a 3-element unit (fewer elements than ranks), an output layer tied to
the embedding and used by another unit, a frozen layer and a layer that is never called.
``zero_test_rank`` runs ``train_rank`` and then the test-only checks: ToyNet under every
wrapper (also from rank-dependent seeds), refusals of differing ranks, damaged checkpoints.
``fault_rank`` runs the faults of test_zero_faults.py.
Spawned ranks import this module: the tests put ``tests/`` on ``sys.path``, as pytest does.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.dist import CommCounter
from labkit.memory.meter import optimizer_tensors, train_step
from labkit.runs.zero import build, make_model, train_rank
from labkit.data_parallel import DataParallelBucketed, DataParallelNaive
from labkit.zero import (CheckpointError, FullyShardedModule, ShardedGradOptimizer, ShardedOptimizer, load_sharded,
                         save_sharded)

TOY_KINDS = ("single", "ddp_naive", "ddp_bucketed", "zero1", "zero2", "zero3")


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


def toy_build(kind, seed=0, init_sync="broadcast"):
    """(net, optimizer, full state dict fn) of ToyNet under ``kind`` (one of TOY_KINDS)."""
    torch.manual_seed(seed)
    model = ToyNet().double()  # float64: the tests compare it to one process at 1e-12
    kw = {"lr": 0.05, "weight_decay": 0.1}
    if kind == "single":
        return model, torch.optim.AdamW(model.parameters(), **kw), model.state_dict
    if kind in ("ddp_naive", "ddp_bucketed"):
        net = DataParallelNaive(model, init_sync=init_sync) if kind == "ddp_naive" \
            else DataParallelBucketed(model, bucket_numel=16, init_sync=init_sync)
        return net, torch.optim.AdamW(model.parameters(), **kw), model.state_dict
    if kind in ("zero1", "zero2"):
        cls = ShardedOptimizer if kind == "zero1" else ShardedGradOptimizer
        opt = cls(model.named_parameters(), torch.optim.AdamW, bucket_numel=16, init_sync=init_sync, **kw)
        return model, opt, model.state_dict
    if kind != "zero3":
        raise ValueError(f"kind={kind!r} is unknown; valid kinds: {list(TOY_KINDS)}")
    net = FullyShardedModule(model, unit_types=(nn.Linear, Gain), init_sync=init_sync)
    return net, torch.optim.AdamW(net.parameters(), **kw), net.full_state_dict


def _toy_batch(step, rank, world_size, global_batch=8, seq_len=4, seed=0):
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randint(7, (global_batch, seq_len), generator=gen)  # (B, T)
    y = torch.randint(7, (global_batch, seq_len), generator=gen)  # (B, T)
    b = global_batch // world_size
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


def toy_rank(rank, world_size, kinds=("zero1", "zero2", "zero3"), steps=3, seed_per_rank=False):
    """Train ToyNet under each kind; losses and params. ``seed_per_rank``: rank r starts from
    seed r (the wrappers broadcast rank 0's); the broadcasts of the wrap are counted."""
    torch.set_num_threads(1)
    out = {}
    for kind in kinds:
        with CommCounter() as comm:
            net, opt, full_state = toy_build(kind, seed=rank if seed_per_rank else 0)
        losses = [train_step(net, opt, _toy_batch(step, rank, world_size), keep_loss=True).item()
                  for step in range(steps)]
        out[kind] = {"losses": losses, "wrap_broadcasts": comm.stats.calls["broadcast"],
                     "params": {k: v.detach().numpy().copy() for k, v in full_state().items()}}
    return out


def refusals(rank, world_size):
    """What each wrapper says, with ``init_sync="check"``, when the last rank starts elsewhere."""
    answers = {}
    for kind in ("zero1", "zero2", "zero3", "ddp_bucketed", "ddp_naive"):
        torch.manual_seed(0)
        model = ToyNet()
        if rank == world_size - 1:
            with torch.no_grad():
                model.fc2.bias[0] += 1e-3
        try:
            if kind == "zero3":
                FullyShardedModule(model, unit_types=(nn.Linear,), init_sync="check")
            elif kind.startswith("ddp"):
                (DataParallelBucketed if kind == "ddp_bucketed" else DataParallelNaive)(model, init_sync="check")
            else:
                cls = ShardedOptimizer if kind == "zero1" else ShardedGradOptimizer
                cls(model.named_parameters(), torch.optim.AdamW, lr=1e-3, init_sync="check")
            answers[kind] = None
        except ValueError as e:
            answers[kind] = str(e)
    return answers


def try_bad_checkpoints(good, dirs, *, preset="tiny", seed=0):
    """Stage 3 loads the good checkpoint, then each damaged one: (error message, whether the
    shards and the optimizer states stayed unchanged)."""
    b = build("zero3", make_model(preset, seed, "cpu"), 3e-3, 0.1)
    load_sharded(good, b.shards, b.opt)  # real optimizer states to compare

    def snapshot():
        return [t.detach().clone() for t in list(b.net.parameters()) + optimizer_tensors(b.opt)]
    results = []
    for d in dirs:
        before = snapshot()
        try:
            load_sharded(d, b.net, b.opt)
            message = None
        except CheckpointError as e:
            message = str(e)
        after = snapshot()
        unchanged = len(before) == len(after) and all(torch.equal(x, y) for x, y in zip(before, after))
        results.append((message, unchanged))
    return results


def zero_test_rank(rank, world_size, kinds, *, toy_kinds=(), toy_seed_per_rank=(), save_toy=None,
                   check_refusals=False, bad_checkpoints=None, **train_kwargs):
    """``train_rank``, then what the tests add: ``toy`` (ToyNet under ``toy_kinds``), ``toy_seeded``
    (under ``toy_seed_per_rank`` from rank-dependent seeds), ``refusals``, ``bad_checkpoints``
    (``{"good": folder, "dirs": [damaged folders]}``); ``save_toy``: a ToyNet stage-3 checkpoint."""
    out = train_rank(rank, world_size, kinds, **train_kwargs)
    if toy_kinds:
        out["toy"] = toy_rank(rank, world_size, toy_kinds)
    if toy_seed_per_rank:
        out["toy_seeded"] = toy_rank(rank, world_size, toy_seed_per_rank, seed_per_rank=True)
    if save_toy:
        net, opt, _ = toy_build("zero3")
        save_sharded(save_toy, net, opt, extra={"step": 0})
    if check_refusals:
        out["refusals"] = refusals(rank, world_size)
    if bad_checkpoints:
        out["bad_checkpoints"] = try_bad_checkpoints(bad_checkpoints["good"], bad_checkpoints["dirs"],
                                                     preset=train_kwargs.get("preset", "tiny"))
    return out



# -- faults: a re-save that fails part-way, AdamW's states into SGD, a parameter used on one rank --

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


__all__ = ["TOY_KINDS", "Gain", "ToyNet", "toy_build", "toy_rank", "refusals", "try_bad_checkpoints",
           "zero_test_rank",
           "BranchNet", "fault_rank"]
