"""``apply_context_parallel``: labkit's GPT trained on sequence shards, attention by ring.

Each rank of the group feeds its shard of the token ids and targets (:func:`shard_sequence`,
B x s/cp); the embeddings, norms, MLPs and head act on its tokens alone, and every attention
layer runs :func:`ring_attention` with the n_kv key-value heads (grouped-query attention sends
the smaller K and V). Positions are global: the learned position table and the rotary angles
are read at the shard's own positions. The loss is normalised over the tokens of the whole
sequence on every rank, and the gradients of the replicated parameters are summed over the group
at the end of each backward pass by the wrapper itself, so a plain training loop is correct.
"""

from __future__ import annotations

import types
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..collectives import INIT_SYNCS, GradSumAfterBackward, sync_initial_state
from ..data import IGNORE_INDEX
from ..validate import check_bool, check_choice, check_int
from .analytic import LAYOUTS, check_cp_seq_len
from .ring import ring_attention
from .shard import shard_positions

__all__ = ["apply_context_parallel", "ContextParallelGradSum", "check_cp_group", "context_parallel_inputs",
           "context_parallel_loss"]


def check_cp_group(group, cp_size: int | None = None) -> tuple[int, int]:
    """(rank in group, cp_size); ValueError if ``cp_size`` is given and differs from the group's size."""
    if not dist.is_initialized():
        raise ValueError("context parallelism needs an initialised process group (labkit.dist.launch)")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of group: pass the context-parallel group it belongs to")
    if cp_size is not None and check_int("cp_size", cp_size, 1) != size:
        raise ValueError(f"cp_size={cp_size} does not match the group, which has {size} ranks")
    return rank, size


class ContextParallelGradSum(GradSumAfterBackward):
    """Sums each backward pass's gradient of ``params`` over ``group`` when the pass ends: the
    replicated parameters' shares of the sequence (labkit.collectives' :class:`GradSumAfterBackward`)."""


def _check_model(model) -> None:
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "blocks") or not hasattr(model, "embed"):
        raise TypeError(f"model ({type(model).__name__}) must be a labkit GPT (labkit.model.GPT)")
    if getattr(model, "cp_size", None) is not None:
        raise ValueError(f"model is already context-parallel over cp_size={model.cp_size}")
    if cfg.dropout > 0:
        raise ValueError(f"dropout={cfg.dropout} must be 0: ring attention implements no attention dropout")
    if cfg.sliding_window is not None:
        raise ValueError(f"sliding_window={cfg.sliding_window} is not supported by ring attention here")


def _global_loss(model, logits, targets):
    """Cross-entropy summed over this rank's tokens over the count of the whole sequence's: its
    gradient is this rank's share; its value, every rank's shares summed, the global mean."""
    group = model._cp_group
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be this rank's shard, like the logits' "
                         f"{tuple(logits.shape[:-1])}")
    n_local = (targets != IGNORE_INDEX).sum()
    n = n_local.detach().clone()
    dist.all_reduce(n, group=group)
    inner = model.__dict__.get("_cp_inner_loss")  # an override's mean, e.g. tensor parallelism's
    if inner is None:
        local = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    else:
        local = inner(logits, targets) * n_local
    share = local / n.clamp(min=1)
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    if model._cp_grad_sum is None:  # a wrapper's mean over the cp ranks (and dp) must sum the shares
        share = share * model.cp_size
    return share + (total - share.detach())  # the value of the global mean, the gradient of the share


def _cp_forward(self, idx, targets=None):
    """This rank's shard idx (B, s/cp) -> logits (B, s/cp, V), or the global mean loss."""
    group, cp = self._cp_group, self.cp_size
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
        raise ValueError(f"idx must be this rank's (B, s/cp) shard of token ids, got {getattr(idx, 'shape', idx)}")
    seq = idx.size(1) * cp
    check_cp_seq_len(seq, cp, self.cp_layout, name="idx.size(1) * cp_size")
    if seq > self.cfg.seq_len:
        raise ValueError(f"idx.size(1)={idx.size(1)} x cp_size={cp} = {seq} tokens exceeds seq_len={self.cfg.seq_len}")
    if not self._cp_checked:  # once: shards of one shape on every rank (else a receive would wait)
        shape = torch.tensor([idx.size(0), idx.size(1), -idx.size(0), -idx.size(1)], device=idx.device)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
        if shape[0] != -shape[2] or shape[1] != -shape[3]:
            raise ValueError(f"mismatched shards: idx {tuple(idx.shape)} on this rank; every rank of the group "
                             "must feed a shard of one shape (B, s/cp)")
        self._cp_checked = True
    pos, attend, rope_pos = context_parallel_inputs(self, idx.size(1), idx.device)
    x = self.embed(idx, pos)  # (B, s/cp, C)
    for block in self.blocks:
        x = block(x, attend, rope_pos)
    logits = self.head(x)  # (B, s/cp, V)
    return logits if targets is None else _global_loss(self, logits, targets)


def context_parallel_inputs(model, shard_len: int, device) -> tuple:
    """What a context-parallel ``model`` feeds its layers for a shard of ``shard_len`` (s/cp)
    tokens: the global positions (s/cp,) for ``embed(idx, pos)``, and ``attend`` and ``rope_pos``
    for each ``block(x, attend, rope_pos)`` (a pipeline's stages call them so, labkit.parallel)."""
    cp, layout = model.cp_size, model.cp_layout
    pos = shard_positions(shard_len * cp, cp, model.cp_rank, layout=layout, device=device)  # (s/cp,) global
    attend = partial(model.cp_attention, group=model._cp_group, causal=True, layout=layout, check=False)
    return pos, attend, pos if model.wpe is None else None  # rotary angles at the global positions


def context_parallel_loss(model, logits, targets):
    """The loss of a context-parallel ``model`` from this rank's logits (B, s/cp, V) and targets
    (B, s/cp): the global mean's value, this rank's share's gradient (a pipeline's last stage)."""
    return _global_loss(model, logits, targets)


def apply_context_parallel(model, group=None, *, layout: str = "zigzag", cp_size: int | None = None,
                           grad_sync: bool = True, init_sync: str | None = "check", attention=None):
    """Make ``model`` train on this rank's sequence shards over ``group`` (None: the default
    group), in place; return it. ``cp_size``, if given, must equal the group's size.
    ``attention``: what each layer attends with, called as :func:`ring_attention` (None: it).
    ``grad_sync``: sum the gradients over the group at the end of backward; False when a wrapper
    averages over the data x context ranks (ZeRO): a rank's gradient is then cp times its share,
    so the mean sums the shares (Megatron-LM scales its loss by cp so). ``init_sync``: "check"
    refuses ranks whose parameters differ, "broadcast" copies group rank 0's, None trusts."""
    check_choice("layout", layout, LAYOUTS)
    check_bool("grad_sync", grad_sync)
    check_choice("init_sync", init_sync, (*INIT_SYNCS, None))
    rank, cp = check_cp_group(group, cp_size)
    _check_model(model)
    if init_sync is not None:
        sync_initial_state(model.named_parameters(), model.named_buffers(), group=group, init_sync=init_sync)
    if "loss" in model.__dict__:  # a technique's own loss (a mean over this rank's tokens)
        model._cp_inner_loss = model.__dict__.pop("loss")
    model.forward = types.MethodType(_cp_forward, model)  # an instance attribute shadows GPT.forward
    model.cp_size, model.cp_rank, model.cp_layout, model._cp_group = cp, rank, layout, group
    model._cp_checked = False
    model.cp_attention = ring_attention if attention is None else attention
    model._cp_grad_sum = ContextParallelGradSum(model.parameters(), group) if grad_sync else None
    return model
