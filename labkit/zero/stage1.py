"""ZeRO stage 1: each rank keeps the optimizer states of 1/N_d of the parameters.

``ShardedOptimizer(params, optimizer_cls, **optimizer_kwargs)`` wraps any elementwise
``torch.optim`` optimizer, as torch's ``ZeroRedundancyOptimizer`` does. The trainable
parameters are laid end to end in flat, padded buckets (:mod:`labkit.zero.flat`); the model's
parameters become views into them. Rank r runs the inner optimizer on its slice of every
parameter only, then an all-gather hands every rank the updated parameters
(Rajbhandari et al. 2020, Section 5.1: P_os, model states 4Ψ + 12Ψ/N_d with mixed precision).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from torch.utils._pytree import tree_leaves

from ..collectives import (all_gather_flat, buckets_by_numel, check_init_sync, reduce_scatter_flat,
                           sync_initial_state)
from ..validate import check_int
from .flat import FlatLayout, param_slice, shard_numel

__all__ = ["ShardedOptimizer", "check_elementwise_optimizer"]


def check_elementwise_optimizer(optimizer_cls, optimizer_kwargs: dict) -> None:
    """Refuse an optimizer whose update is not per parameter and elementwise.

    Sharding splits a parameter between ranks, so the optimizer must give the same result on
    a parameter cut into pieces as on the whole. LBFGS (a closure and one global state),
    Adafactor (factored 2-D state) or a per-tensor trust ratio fail this probe.
    """
    name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls={name} must be a torch.optim.Optimizer subclass, e.g. torch.optim.AdamW")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2, 3, generator=gen)  # a parameter (2, 3), and the same cut into 4 + 2 elements
    grads = [torch.randn(2, 3, generator=gen) for _ in range(2)]
    whole = nn.Parameter(w.clone())
    parts = [nn.Parameter(w.reshape(-1)[:4].clone()), nn.Parameter(w.reshape(-1)[4:].clone())]
    opt_whole, opt_parts = optimizer_cls([whole], **optimizer_kwargs), optimizer_cls(parts, **optimizer_kwargs)
    valid = "Adam, AdamW, SGD, Adagrad, RMSprop and other elementwise torch.optim optimizers"
    try:
        for g in grads:
            whole.grad = g.clone()
            parts[0].grad, parts[1].grad = g.reshape(-1)[:4].clone(), g.reshape(-1)[4:].clone()
            opt_whole.step()
            opt_parts.step()
    except Exception as e:  # LBFGS: step() needs a closure
        raise ValueError(f"optimizer_cls={name} cannot be sharded: step() without a closure failed on a dense "
                         f"gradient ({type(e).__name__}: {e}). ZeRO shards optimizers whose state is per "
                         f"parameter and elementwise: {valid}") from e
    extra = [k for k in opt_whole.state if k is not whole]
    for key, value in opt_whole.state.get(whole, {}).items():
        if isinstance(value, torch.Tensor) and value.numel() > 1 and value.shape != whole.shape:
            extra.append(f"{key} of shape {tuple(value.shape)} for a (2, 3) parameter")
    split = torch.cat([p.detach() for p in parts])
    if extra or not torch.allclose(whole.detach().reshape(-1), split, rtol=1e-5, atol=1e-7):
        raise ValueError(f"optimizer_cls={name} cannot be sharded: its state is not per parameter and "
                         f"elementwise ({extra or 'a parameter cut in two updates differently'}); "
                         f"valid choices: {valid}")


class _Bucket:
    """Parameters laid end to end in one flat padded buffer; this rank's slice of each.

    ``flat`` (P,) holds the parameters (they become views of it); ``slices[i]``, made by
    ``new_slice`` from a view of ``flat``, is the part of parameter i in [start, start + S);
    ``bounds[i] = (a, b)`` in the parameter's flat coordinates.
    """

    def __init__(self, names, params, rank, world_size, new_slice):
        self.names, self.params = list(names), list(params)
        self.layout = FlatLayout.of(names, params)
        self.S = shard_numel(self.layout.numel, world_size)
        self.start = rank * self.S
        with torch.no_grad():
            self.flat = self.layout.flatten([p.detach() for p in params], world_size)  # (P,)
            for p, view in zip(params, self.layout.views(self.flat)):
                p.data = view
        self.bounds, self.slices = [], []
        for p, off, n in zip(params, self.layout.offsets, self.layout.numels()):
            a, b = param_slice(off, n, self.start, self.start + self.S)
            self.bounds.append((a, b))
            self.slices.append(new_slice(p.detach().reshape(-1)[a:b]))

    def shard_coords(self, i):
        """Where parameter i's slice sits in this rank's shard (S,)."""
        a, b = self.bounds[i]
        off = self.layout.offsets[i] + a - self.start
        return off, off + (b - a)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: ``ShardedOptimizer(params, optimizer_cls, **optimizer_kwargs)``.

    ``reduce_grads=True`` (no data-parallel wrapper): ``step`` reduce-scatters the averaged
    gradients, Ψ elements, then all-gathers the parameters, Ψ: 2Ψ in all. Under DDP (which
    already averages them) pass ``reduce_grads=False``. ``bucket_numel`` caps a flat bucket
    (default: one per parameter group). Frozen parameters stay out; a parameter without a
    gradient (on every rank, as DDP requires) is skipped, as torch's optimizers do. ``params``
    may come from ``named_parameters()``: the names then appear in errors and checkpoints.
    ``init_sync``: ``"broadcast"`` rank 0's parameters to every rank first, or ``"check"`` them.
    """

    def __init__(self, params, optimizer_cls, *, group=None, reduce_grads: bool = True,
                 bucket_numel: int | None = None, init_sync: str = "broadcast", **optimizer_kwargs):
        check_elementwise_optimizer(optimizer_cls, optimizer_kwargs)
        if bucket_numel is not None:
            check_int("bucket_numel", bucket_numel, 1)
        check_init_sync(init_sync)
        super().__init__(params, dict(optimizer_kwargs))
        self.group, self.reduce_grads = group, bool(reduce_grads)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        named = [[(self._name(g, gi, pi), p) for pi, p in enumerate(g["params"])]
                 for gi, g in enumerate(self.param_groups)]
        flat_named = [item for group_named in named for item in group_named]
        sync_initial_state(flat_named, group=group, init_sync=init_sync)
        self._order = {n: i for i, (n, _) in enumerate(flat_named)}
        self._buckets, inner_groups = [], []
        for g, group_named in zip(self.param_groups, named):
            trainable = self._bucket_order([(n, p) for n, p in group_named if p.requires_grad])
            buckets = [_Bucket([n for n, _ in chunk], [p for _, p in chunk], self.rank, self.world_size,
                               self._new_slice)
                       for chunk in buckets_by_numel(trainable, lambda item: item[1].numel(), bucket_numel)]
            self._buckets += buckets
            slices = [s for b in buckets for s in b.slices]
            inner_groups.append({**self._hyper(g), "params": slices})
        self.inner = optimizer_cls(inner_groups, **optimizer_kwargs)
        for g, ig in zip(self.param_groups, self.inner.param_groups):  # fill in the class defaults
            g.update(self._hyper(ig))
        self.state = self.inner.state  # keyed by the slices

    @staticmethod
    def _name(group, gi, pi):
        names = group.get("param_names")  # given when params came from named_parameters()
        return names[pi] if names else f"group{gi}.param{pi}"

    @staticmethod
    def _hyper(group):
        return {k: v for k, v in group.items() if k not in ("params", "param_names")}

    def _bucket_order(self, named):
        """The order parameters fill buckets in: the model's."""
        return named

    def _new_slice(self, part):
        """This rank's slice of a parameter, the leaf the inner optimizer updates: a view of ``flat``."""
        return nn.Parameter(part)

    # -- one step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, ig in zip(self.param_groups, self.inner.param_groups):  # e.g. an LR scheduler's lr
            ig.update(self._hyper(g))
        self._shard_grads()
        self.inner.step()
        self._gather_params()
        return loss

    def _set_slice_grad(self, bucket, i, grad_part):
        s = bucket.slices[i]
        s.grad = grad_part if s.grad is None else s.grad.add_(grad_part)

    def _shard_grads(self):
        """Give every slice its gradient (reduce-scattered when ``reduce_grads``)."""
        for b in self._buckets:
            for s in b.slices:
                s.grad = None
            grads = [p.grad for p in b.params]
            if not self.reduce_grads:  # averaged already by a data-parallel wrapper: slice it
                for i, g in enumerate(grads):
                    if g is not None:
                        self._set_slice_grad(b, i, g.reshape(-1)[b.bounds[i][0]:b.bounds[i][1]])
                continue
            # every rank reduces every bucket, even one without gradients here: a rank-local
            # skip would leave the other ranks waiting in the collective
            flat_grad = b.layout.flatten(grads, self.world_size, dtype=b.flat.dtype, device=b.flat.device)
            flat_grad.div_(self.world_size)  # the mean over ranks, as DDP takes it
            shard = reduce_scatter_flat(flat_grad, self.world_size, self.group)  # (S,)
            for i, g in enumerate(grads):
                if g is not None:
                    lo, hi = b.shard_coords(i)
                    self._set_slice_grad(b, i, shard[lo:hi])

    def _gather_params(self):
        """Every rank's updated slices to every rank: one all-gather per bucket."""
        for b in self._buckets:
            mine = b.flat[b.start:b.start + b.S]
            all_gather_flat(mine.clone(), self.world_size, self.group, out=b.flat)

    def zero_grad(self, set_to_none: bool = True):
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        for b in self._buckets:
            for s in b.slices:
                s.grad = None

    # -- what the memory meter and the checkpoints read -------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """The inner optimizer's states."""
        return [t for t in tree_leaves(list(self.inner.state.values())) if isinstance(t, torch.Tensor)]

    def bucket_numels(self) -> list[int]:
        """Ψ_g of each flat bucket, before padding."""
        return [b.layout.numel for b in self._buckets]

    def shard_entries(self):
        """(key, shape, (a, b), slice) for every trainable parameter, in a fixed order."""
        entries = [(name, tuple(p.shape), b.bounds[i], b.slices[i])
                   for b in self._buckets for i, (name, p) in enumerate(zip(b.names, b.params))]
        return sorted(entries, key=lambda e: self._order[e[0]])

    @torch.no_grad()
    def load_entry_values(self, values: dict) -> None:
        """Set every parameter from full flat values keyed like the entries."""
        for b in self._buckets:
            for name, p in zip(b.names, b.params):
                p.copy_(values[name].view(p.shape))

    def state_dict(self):
        raise NotImplementedError("a ShardedOptimizer's state is split over ranks: save it with "
                                  "labkit.zero.save_sharded")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("load a sharded checkpoint with labkit.zero.load_sharded")
