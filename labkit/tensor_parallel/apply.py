"""``apply_tensor_parallel``: labkit's GPT in its tensor-parallel form on this rank.

Each shard is cut from the full model, so a seeded full model and its sharded versions can be
compared. Attention is split by heads (c_attn column-parallel by q, k and v, c_proj
row-parallel), the MLP by its 4h columns, the tied embedding by vocabulary rows; the loss is the
vocabulary-parallel cross-entropy. With ``sequence_parallel`` the LayerNorm and dropout regions
run on (B, T/t, C) sequence shards (Korthikanti et al. 2022); then call
:func:`sync_sequence_parallel_grads` after backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .comm import check_seq_divisible
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLoss

__all__ = ["apply_tensor_parallel", "check_tp_size", "sync_sequence_parallel_grads", "ParallelSelfAttention",
           "SequenceShardedEmbedding"]


def check_tp_size(tp_size: int, n_head: int | None = None, d_model: int | None = None,
                  vocab_size: int | None = None) -> None:
    """Raise ValueError unless ``tp_size`` divides n_head, d_model and vocab_size (then it also
    divides the MLP's 4 d_model).

    No padding rule: pad the vocabulary to a multiple of t yourself (Megatron pads it to a
    multiple of 128 t with unused rows).
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} must be an int >= 1")
    for name, value in (("n_head", n_head), ("d_model", d_model), ("vocab_size", vocab_size)):
        if value is not None and value % tp_size:
            hint = " (pad the vocabulary to a multiple of tp_size)" if name == "vocab_size" else ""
            raise ValueError(f"tp_size={tp_size} must divide {name}={value}{hint}")


class ParallelSelfAttention(nn.Module):
    """Causal self-attention over this rank's n_head / t heads: the model's own forward, except
    that T is read from c_attn's output (under sequence parallelism its input holds T/t)."""

    def __init__(self, attn, group, sequence_parallel: bool):
        super().__init__()
        self.head_dim, self.dropout = attn.head_dim, attn.dropout
        self.c_attn = ColumnParallelLinear(attn.c_attn, group, chunks=3, sequence_parallel=sequence_parallel,
                                           name="d_model")
        self.c_proj = RowParallelLinear(attn.c_proj, group, sequence_parallel=sequence_parallel, name="d_model")
        self.core = attn.core

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3 nh/t hs): the whole sequence, this rank's heads
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)  # 3 x (B, T, nh/t hs)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh/t, T, hs)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh/t, T, hs)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh/t, T, hs)
        y = self.core(q, k, v)  # (B, nh/t, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh/t hs)
        y = self.c_proj(y)  # (B, T, C), or (B, T/t, C) under sequence parallelism
        if self.training and self.dropout > 0:
            y = F.dropout(y, p=self.dropout, training=True)
        return y


class SequenceShardedEmbedding(nn.Embedding):
    """Position embeddings of this rank's positions only: pos (T,) or (B, T) -> (..., T/t, C)."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__(embedding.num_embeddings, embedding.embedding_dim,
                         _weight=embedding.weight.detach().clone())  # given a weight: no init, no RNG draw
        self.rank, self.tp_size = dist.get_rank(group), dist.get_world_size(group)
        self.weight.sequence_parallel = True

    def forward(self, pos):
        check_seq_divisible(pos.size(-1), self.tp_size)
        mine = pos.unflatten(-1, (self.tp_size, -1)).select(-2, self.rank)  # (..., T/t): this rank's
        return super().forward(mine)  # (..., T/t, C)


def _mark_sequence_parallel(module: nn.Module) -> None:
    for p in module.parameters():
        p.sequence_parallel = True


def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` in place over ``group`` (``None``: the default group) and return it.

    Transforms what is present: ``wte``/``wpe`` (embedding), each of ``blocks``, ``ln_f``/``lm_head``
    (head; ``model.loss`` becomes the vocabulary-parallel loss and the logits stay (B, T, V/t)).
    Needs dropout 0: masks drawn on replicated activations would differ between ranks.
    """
    t = dist.get_world_size(group)
    sp = bool(sequence_parallel)
    if getattr(model, "tp_size", None) is not None:
        raise ValueError(f"model is already tensor-parallel over tp_size={model.tp_size}; the group has "
                         f"size {t}: apply_tensor_parallel to the full model")
    blocks = list(getattr(model, "blocks", []))
    wte, wpe = getattr(model, "wte", None), getattr(model, "wpe", None)
    lm_head, ln_f = getattr(model, "lm_head", None), getattr(model, "ln_f", None)
    for block in blocks:
        attn = block.attn
        check_tp_size(t, n_head=attn.c_attn.out_features // 3 // attn.head_dim, d_model=attn.c_proj.out_features)
        if attn.dropout > 0:
            raise ValueError(f"dropout={attn.dropout} must be 0 under tensor parallelism here: ranks would draw "
                             "different masks on replicated activations (Megatron keeps an RNG tracker for it)")
    vocab = wte.num_embeddings if wte is not None else (lm_head.out_features if lm_head is not None else None)
    check_tp_size(t, vocab_size=vocab)
    for block in blocks:
        block.attn = ParallelSelfAttention(block.attn, group, sp)
        block.mlp.c_fc = ColumnParallelLinear(block.mlp.c_fc, group, sequence_parallel=sp, name="4 * d_model")
        block.mlp.c_proj = RowParallelLinear(block.mlp.c_proj, group, sequence_parallel=sp, name="4 * d_model")
        if sp:
            _mark_sequence_parallel(block.ln_1)
            _mark_sequence_parallel(block.ln_2)
    tied = wte is not None and lm_head is not None and lm_head.weight is wte.weight
    if wte is not None:
        model.wte = VocabParallelEmbedding(wte, group, sequence_parallel=sp)
    if wpe is not None and sp:
        model.wpe = SequenceShardedEmbedding(wpe, group)
    if lm_head is not None:
        model.lm_head = ColumnParallelLinear(lm_head, group, sequence_parallel=sp, name="vocab_size")
        if tied:
            model.lm_head.weight = model.wte.weight  # one (V/t, C) shard, as one (V, C) weight before
        # an instance attribute shadows GPT.loss, which forward() calls
        model.loss = VocabParallelLoss(group, vocab_start=dist.get_rank(group) * model.lm_head.out_features)
    if ln_f is not None and sp:
        _mark_sequence_parallel(ln_f)
    model.tp_size, model.sequence_parallel = t, sp
    return model


@torch.no_grad()
def sync_sequence_parallel_grads(model: nn.Module, group) -> None:
    """Sum over the group the gradients of replicated parameters used on sequence shards.

    LayerNorms, row-parallel biases and position embeddings see T/t positions per rank, so
    each rank's gradient is partial. One all-reduce of their flattened gradients.
    """
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # (n,)
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
