"""Tensor-parallel layers, each cut from a full layer: this rank keeps its shard of the weight.

``ColumnParallelLinear`` (Y_i = X A_i, output columns split), ``RowParallelLinear``
(Y = sum_i X_i B_i, input rows split), ``VocabParallelEmbedding`` (vocabulary rows split) and
``vocab_parallel_cross_entropy`` (the loss over vocabulary-split logits, never gathered whole):
Shoeybi et al. (2019), Section 3. ``sequence_parallel=True`` swaps f and g for the all-gather /
reduce-scatter pair of Korthikanti et al. (2022); replicated parameters used on a sequence shard
are marked ``p.sequence_parallel = True``: their gradients must be summed over the group
(``apply_tensor_parallel`` does it at the end of backward; layers used alone, through
``sync_sequence_parallel_grads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from ..validate import check_bool, check_int
from .comm import (GroupRef, all_gather_seq, check_group, copy_to_tp, reduce_from_tp,
                   reduce_scatter_seq, reduce_scatter_to_sp)

__all__ = ["shard_indices", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "VocabParallelLoss"]


def shard_indices(n: int, rank: int, tp_size: int, chunks: int | tuple[int, ...] = 1,
                  name: str = "n") -> torch.Tensor:
    """Indices of rank's part of ``n`` rows laid out as ``chunks`` blocks: an int, that many equal
    blocks (qkv of multi-head attention: 3), or a tuple of the blocks' sizes (grouped-query
    attention: n_head hs, n_kv_head hs, n_kv_head hs).

    Rank r takes the r-th 1/t of every block: for c_attn, its heads' rows of q, of k and of v.
    """
    check_int(name, n, minimum=1)
    check_int("tp_size", tp_size, minimum=1)
    check_int("rank", rank, minimum=0, maximum=tp_size - 1)  # -1 would take the last rank's rows
    if isinstance(chunks, tuple):
        sizes = [check_int(f"chunks[{i}]", c, minimum=1) for i, c in enumerate(chunks)]
        if sum(sizes) != n or any(c % tp_size for c in sizes):
            raise ValueError(f"chunks={chunks} must sum to {name}={n} and each be divisible by tp_size={tp_size}")
    else:
        check_int("chunks", chunks, minimum=1)
        if n % (chunks * tp_size):
            raise ValueError(f"tp_size={tp_size} must divide {name}={n // chunks}")
        sizes = [n // chunks] * chunks
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()
    return torch.cat([start + rank * (c // tp_size) + torch.arange(c // tp_size) for start, c in zip(starts, sizes)])


def _check_module(name: str, module, kind) -> None:
    if not isinstance(module, kind):
        raise TypeError(f"{name} must be a torch.nn.{kind.__name__}, got {type(module).__name__}")


class _GroupHolder(nn.Module):
    """A module that communicates over ``self.group`` (kept in a :class:`GroupRef`)."""

    def _hold(self, group, sequence_parallel):
        self.sequence_parallel = check_bool("sequence_parallel", sequence_parallel)
        info = check_group(group, type(self).__name__)
        self._group = GroupRef(group)
        return info

    @property
    def group(self):
        return self._group.group


class _GatherLinear(torch.autograd.Function):
    """Y = all_gather(X_shard) A_i + b_i, keeping only X_shard (B, T/t, C) for backward.

    Backward gathers X again for the weight gradient and reduce-scatters the input gradient
    (Korthikanti et al. 2022, Section 4.2.2): the saved input shrinks by t for one more all-gather.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_seq(x, group), weight, bias)  # (B, T, out/t)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x_full = all_gather_seq(x, ctx.group)  # (B, T, C) again
        grad_x = reduce_scatter_seq(grad @ weight, ctx.group)  # (B, T/t, C)
        g2 = grad.reshape(-1, grad.size(-1))  # (B T, out/t)
        grad_w = g2.t() @ x_full.reshape(-1, x_full.size(-1))  # (out/t, C)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class ColumnParallelLinear(_GroupHolder):
    """This rank's ``out_features / t`` outputs of ``linear``: (B, T, C) -> (B, T, out/t).

    ``chunks``: the output is that many equal blocks, or blocks of these sizes, each split on its
    own (qkv: 3, or the q, k, v widths under grouped-query attention). Forward
    runs f first (or, with ``sequence_parallel``, gathers a (B, T/t, C) input).
    """

    def __init__(self, linear: nn.Linear, group, *, chunks: int | tuple[int, ...] = 1, sequence_parallel: bool = False,
                 name: str = "out_features"):
        super().__init__()
        _check_module("linear", linear, nn.Linear)
        rank, self.tp_size = self._hold(group, sequence_parallel)
        rows = shard_indices(linear.out_features, rank, self.tp_size, chunks, name)
        self.in_features, self.out_features = linear.in_features, rows.numel()
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())  # (out/t, in)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x):
        if self.sequence_parallel:
            return _GatherLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(_GroupHolder):
    """This rank's ``in_features / t`` inputs of ``linear``: (B, T, in/t) -> (B, T, C).

    The ranks' partial products are summed by g (or reduce-scattered to (B, T/t, C) with
    ``sequence_parallel``); the bias, replicated, is added once, after the sum.
    """

    def __init__(self, linear: nn.Linear, group, *, sequence_parallel: bool = False, name: str = "in_features"):
        super().__init__()
        _check_module("linear", linear, nn.Linear)
        rank, self.tp_size = self._hold(group, sequence_parallel)
        cols = shard_indices(linear.in_features, rank, self.tp_size, 1, name)
        self.in_features, self.out_features = cols.numel(), linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())  # (out, in/t)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        if self.bias is not None and self.sequence_parallel:
            self.bias.sequence_parallel = True  # added on a sequence shard: partial gradients

    def forward(self, x):
        y = F.linear(x, self.weight)  # (B, T, C), this rank's partial sum
        y = reduce_scatter_to_sp(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(_GroupHolder):
    """Rows [r V/t, (r+1) V/t) of ``embedding``: ids (B, T) -> (B, T, C) (or (B, T/t, C) with SP).

    A rank looks up the ids in its range, zeroes the rest, and the ranks' outputs are summed.
    """

    def __init__(self, embedding: nn.Embedding, group, *, sequence_parallel: bool = False):
        super().__init__()
        _check_module("embedding", embedding, nn.Embedding)
        rank, self.tp_size = self._hold(group, sequence_parallel)
        V = embedding.num_embeddings
        rows = shard_indices(V, rank, self.tp_size, 1, "vocab_size")
        self.num_embeddings, self.vocab_start = rows.numel(), rank * rows.numel()
        self.weight = nn.Parameter(embedding.weight.detach()[rows].clone())  # (V/t, C)

    def forward(self, idx):
        V = self.num_embeddings * self.tp_size
        if idx.numel() and not (idx.is_meta or is_fake(idx)):  # an id no rank holds would embed as 0
            lo, hi = (int(x) for x in idx.aminmax())
            if lo < 0 or hi >= V:
                raise ValueError(f"token id {lo if lo < 0 else hi} is outside [0, vocab_size={V})")
        local = idx - self.vocab_start  # (B, T)
        outside = (local < 0) | (local >= self.num_embeddings)  # (B, T) bool
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # ids of other ranks contribute 0
        return reduce_scatter_to_sp(out, self.group) if self.sequence_parallel else reduce_from_tp(out, self.group)


def _max_and_check_start(logits, group, vocab_start):
    """The row max over every rank's columns (N,), with one more element: whether some rank's
    ``vocab_start`` is not rank * V/t. Every rank learns it from the same all-reduce and raises
    with the others, so a rank given a wrong start cannot leave the rest waiting."""
    rank, Vt = dist.get_rank(group), logits.size(-1)
    ok = isinstance(vocab_start, int) and not isinstance(vocab_start, bool) and vocab_start == rank * Vt
    m = logits.max(dim=-1).values  # (N,)
    m = torch.cat([m, torch.tensor([0.0 if ok else 1.0], dtype=m.dtype, device=m.device)])  # (N + 1,)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    if m[-1].item():
        raise ValueError(f"vocab_start={vocab_start!r} on rank {rank} (rank * V/t = {rank * Vt}), or on another "
                         "rank of the group, is not rank * V/t: the ranks' columns must tile [0, V) in rank "
                         "order, or a target would be counted by no rank or by two")
    return m[:-1]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean of log(sum_v exp z_v) - z_target over rows, with the vocabulary split over ranks.

    Three all-reduces of (N,) vectors: the max (for stability), the target logit, the sum of exps.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, ignore_index):
        Vt = logits.size(-1)
        m = _max_and_check_start(logits, group, vocab_start)  # (N,), over the whole vocabulary
        z = logits - m.unsqueeze(-1)  # (N, V/t)
        local = targets - vocab_start  # (N,)
        hit = (local >= 0) & (local < Vt) & (targets != ignore_index)  # (N,) this rank holds the target
        local = local.masked_fill(~hit, 0)
        z_target = z.gather(1, local.unsqueeze(1)).squeeze(1) * hit  # (N,)
        dist.all_reduce(z_target, group=group)
        exp = z.exp_()  # (N, V/t), in place of z
        sum_exp = exp.sum(-1)  # (N,)
        dist.all_reduce(sum_exp, group=group)
        valid = targets != ignore_index  # (N,)
        count = valid.sum()
        loss = ((sum_exp.log() - z_target) * valid).sum() / count
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # (N, V/t)
        ctx.save_for_backward(softmax, local, hit, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, hit, valid, count = ctx.saved_tensors
        scale = (valid.to(softmax.dtype) * grad / count).unsqueeze(-1)  # (N, 1)
        g = softmax * scale  # (N, V/t): softmax - onehot(target), scaled
        rows = torch.arange(g.size(0), device=g.device)
        g[rows, local] -= hit.to(g.dtype) * scale.squeeze(-1)
        return g, None, None, None, None


class VocabParallelLoss:
    """``loss(logits, targets)`` of a vocabulary-parallel model: what ``model.loss`` becomes."""

    def __init__(self, group, vocab_start: int):
        self._group, self.vocab_start = GroupRef(group), vocab_start

    def __call__(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self._group.group, self.vocab_start)


def _check_targets(targets, V: int, ignore_index: int) -> None:
    """Every rank holds the same targets: all of them raise together, none waits for the others."""
    kept = targets != ignore_index
    bad = kept & ((targets < 0) | (targets >= V))
    if bool(bad.any()):
        raise ValueError(f"target {int(targets[bad][0])} is outside [0, vocab_size={V}): targets are token ids, "
                         f"and a position to leave out of the loss is marked {ignore_index} (ignore_index)")
    if targets.numel() and not bool(kept.any()):
        raise ValueError(f"every target is {ignore_index} (ignore_index): the mean over no positions is "
                         "undefined (torch returns nan); give at least one target")


def vocab_parallel_cross_entropy(logits, targets, group, vocab_start: int, ignore_index: int = -100):
    """Mean cross-entropy of (B, T, V/t) vocabulary-split logits against (B, T) targets.

    ``vocab_start``: the first vocabulary id of this rank's columns. The full (B, T, V)
    logits never exist on any rank (Shoeybi et al. 2019, Section 3). Targets outside [0, V)
    other than ``ignore_index``, or all of them ignored, raise ValueError as the model's loss does.
    """
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.dtype == torch.bool:
        what = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise TypeError(f"targets must be an integer tensor of token ids, got {what}")
    if targets.dim() != 2 or tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must be (B, T, V/t) "
                         "and (B, T): one target per position")
    t = check_group(group, "vocab_parallel_cross_entropy")[1]  # vocab_start: checked on every rank at once
    B, T = targets.shape
    _check_targets(targets, logits.size(-1) * t, ignore_index)
    return _VocabParallelCrossEntropy.apply(logits.reshape(B * T, -1), targets.reshape(B * T), group,
                                            vocab_start, ignore_index)
