"""``apply_tensor_parallel``: labkit's GPT in its tensor-parallel form on this rank.

Each shard is cut from the full model, so a seeded full model and its sharded versions can be
compared. Attention is split by heads (c_attn column-parallel by q, k and v, c_proj
row-parallel): a rank keeps n_head/t query heads and the n_kv_head/t key-value heads they read
(grouped-query attention; t must divide n_kv_head). The MLP is split by its d_ff columns (GELU's
c_fc, or SwiGLU's gate c_gate and up c_fc, column-parallel; c_proj row-parallel), the embedding
and the output layer (tied or not) by vocabulary rows; the loss is the vocabulary-parallel
cross-entropy. Rotary positions rotate the whole sequence's q and k, so they are global under
sequence parallelism too. With ``sequence_parallel`` the norm (LayerNorm or RMSNorm) and dropout
regions run on (B, T/t, C) sequence shards (Korthikanti et al. 2022), and the gradients of the
parameters used there are summed over the group at the end of each backward pass by itself
(:mod:`.sync`). A mixture-of-experts layer is kept whole on every rank (:mod:`.experts`). Called
without targets, the model returns whole (B, T, V) logits on every rank.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..collectives import broadcast_from_rank0, check_same_across_ranks, group_src
from ..layers import SwiGLU, repeat_kv
from ..model import check_gpt2_block
from ..moe.layer import MoE
from ..validate import check_bool, check_choice, check_int
from .comm import GroupRef, check_group, check_seq_divisible, gather_from_tp
from .experts import replicate_moe
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLoss, column_parallel
from .sync import SequenceParallelGradSync, sync_sequence_parallel_grads

__all__ = ["apply_tensor_parallel", "check_tp_size", "sync_sequence_parallel_grads", "ParallelSelfAttention",
           "ParallelSwiGLU", "SequenceShardedEmbedding", "INIT_SYNCS"]

# How apply_tensor_parallel makes sure the ranks start from the same model: refuse ranks whose
# parameters differ ("check", the default), copy rank 0's to every rank ("broadcast"), or trust
# the caller (None: every rank cut its shards from the same tensors, as the tests' twins do).
INIT_SYNCS = ("check", "broadcast", None)


_HINTS = {"vocab_size": " (pad the vocabulary to a multiple of tp_size)",
          "n_kv_head": (": each rank keeps whole key-value heads, those its n_head/tp_size query heads read; "
                        "pick a tp_size that divides n_kv_head (KV heads are not replicated here)")}


def check_tp_size(tp_size: int, n_head: int | None = None, d_model: int | None = None,
                  vocab_size: int | None = None, *, n_kv_head: int | None = None, d_ff: int | None = None) -> None:
    """Raise ValueError unless ``tp_size`` divides n_head, d_model, vocab_size, and where given
    n_kv_head (grouped-query attention) and d_ff (the MLP's width; GPT-2's 4 d_model by default).

    No padding rule: pad the vocabulary to a multiple of t yourself (Megatron pads it to a
    multiple of 128 t with unused rows).
    """
    check_int("tp_size", tp_size, minimum=1)
    for name, value in (("n_head", n_head), ("n_kv_head", n_kv_head), ("d_model", d_model), ("d_ff", d_ff),
                        ("vocab_size", vocab_size)):
        if value is not None and check_int(name, value, minimum=1) % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide {name}={value}{_HINTS.get(name, '')}")


def _heads(attn) -> tuple[int, int]:
    """(n_head, n_kv_head) of a model's attention, read from c_attn's (nh + 2 n_kv) hs rows."""
    width = attn.c_attn.out_features // attn.head_dim  # nh + 2 n_kv
    q_per_kv = getattr(attn, "q_per_kv", 1)
    n_kv = width // (q_per_kv + 2)
    return q_per_kv * n_kv, n_kv


class ParallelSelfAttention(nn.Module):
    """Causal self-attention over this rank's n_head / t query heads and the n_kv_head / t
    key-value heads they read: the model's own forward, except that T is read from c_attn's
    output (under sequence parallelism its input holds T/t, and rotary positions are those of
    the whole sequence, gathered before c_attn)."""

    def __init__(self, attn, group, sequence_parallel: bool):
        super().__init__()
        self.head_dim, self.dropout, self.q_per_kv = attn.head_dim, attn.dropout, getattr(attn, "q_per_kv", 1)
        n_head, n_kv = _heads(attn)
        blocks = (n_head * self.head_dim, n_kv * self.head_dim, n_kv * self.head_dim)  # q, k, v rows
        self.c_attn = ColumnParallelLinear(attn.c_attn, group, chunks=blocks, sequence_parallel=sequence_parallel,
                                           name="d_model")
        self.c_proj = RowParallelLinear(attn.c_proj, group, sequence_parallel=sequence_parallel, name="d_model")
        self.rope, self.core = getattr(attn, "rope", None), attn.core

    def forward(self, x, attend=None, pos=None):
        """``attend(q, k, v)``, when given, replaces ``core``: a KV cache holding this rank's heads;
        ``pos``: the positions rotary embeddings rotate by (default 0..T-1)."""
        qkv = self.c_attn(x)  # (B, T, (nh + 2 n_kv)/t hs): the whole sequence, this rank's heads
        B, T, _ = qkv.shape
        kv_width = qkv.size(-1) // (self.q_per_kv + 2)  # n_kv/t hs
        q, k, v = qkv.split([self.q_per_kv * kv_width, kv_width, kv_width], dim=-1)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh/t, T, hs)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv/t, T, hs)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv/t, T, hs)
        if self.rope is not None:
            q, k = self.rope(q, k, pos)  # absolute positions of the whole sequence
        if attend is None:
            k, v = repeat_kv(k, self.q_per_kv), repeat_kv(v, self.q_per_kv)  # (B, nh/t, T, hs)
            y = self.core(q, k, v)  # (B, nh/t, T, hs)
        else:
            y = attend(q, k, v)  # (B, nh/t, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh/t hs)
        y = self.c_proj(y)  # (B, T, C), or (B, T/t, C) under sequence parallelism
        if self.training and self.dropout > 0:
            y = F.dropout(y, p=self.dropout, training=True)
        return y


class SequenceShardedEmbedding(nn.Embedding):
    """Position embeddings of this rank's positions only: pos (T,) or (B, T) -> (..., T/t, C)."""

    def __init__(self, embedding: nn.Embedding, group):
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"embedding must be a torch.nn.Embedding, got {type(embedding).__name__}")
        rank, t = check_group(group, "SequenceShardedEmbedding")
        super().__init__(embedding.num_embeddings, embedding.embedding_dim,
                         _weight=embedding.weight.detach().clone())  # given a weight: no init, no RNG draw
        self.rank, self.tp_size = rank, t
        self.weight.sequence_parallel = True

    def forward(self, pos):
        check_seq_divisible(pos.size(-1), self.tp_size)
        mine = pos.unflatten(-1, (self.tp_size, -1)).select(-2, self.rank)  # (..., T/t): this rank's
        return super().forward(mine)  # (..., T/t, C)


def _mark_sequence_parallel(module: nn.Module) -> None:
    for p in module.parameters():
        p.sequence_parallel = True


_PARTS = ("wte", "wpe", "blocks", "lm_head", "ln_f")  # what apply_tensor_parallel transforms
# the Llama-family fields it shards: all (a sliding window lives in the attention core's mask,
# which each rank applies to its own heads unchanged)
_SUPPORTS = ("norm", "mlp", "pos", "n_kv_head", "d_ff", "tie_embeddings", "bias", "sliding_window", "n_positions",
             "n_experts")  # a MoE layer is kept whole on every rank (.experts)


def _check_shardable(model: nn.Module, t: int) -> None:
    """Refuse a model already sharded, a tp_size that does not divide its shapes, and dropout."""
    if not isinstance(model, nn.Module) or not any(getattr(model, part, None) is not None for part in _PARTS):
        raise TypeError(f"model ({type(model).__name__}) has none of {', '.join(_PARTS)}: expected a labkit GPT "
                        "or a pipeline stage's part of one")
    if getattr(model, "cfg", None) is not None:
        check_gpt2_block(model.cfg, "apply_tensor_parallel", supports=_SUPPORTS)
    if getattr(model, "tp_size", None) is not None:
        raise ValueError(f"model is already tensor-parallel over tp_size={model.tp_size}; the group has "
                         f"size {t}: apply_tensor_parallel to the full model")
    for block in getattr(model, "blocks", []):
        attn = block.attn
        n_head, n_kv = _heads(attn)
        check_tp_size(t, n_head=n_head, d_model=attn.c_proj.out_features, n_kv_head=n_kv,
                      d_ff=None if isinstance(block.mlp, MoE) else block.mlp.c_proj.in_features)
        if attn.dropout > 0:
            raise ValueError(f"dropout={attn.dropout} must be 0 under tensor parallelism here: ranks would draw "
                             "different masks on replicated activations (Megatron keeps an RNG tracker for it)")
    wte, lm_head = getattr(model, "wte", None), getattr(model, "lm_head", None)
    vocab = wte.num_embeddings if wte is not None else (lm_head.out_features if lm_head is not None else None)
    check_tp_size(t, vocab_size=vocab)


def _sync_initial_state(model: nn.Module, group, init_sync) -> None:
    """Make the ranks start from the same full model, or refuse them (see ``INIT_SYNCS``)."""
    if init_sync == "broadcast":
        broadcast_from_rank0([p for p in model.parameters()], group)
    elif init_sync == "check":
        check_same_across_ranks(model.named_parameters(), group, what="parameters")


def _check_same_batch(tensors, group) -> None:
    """Raise ValueError on every rank of ``group`` unless all of them hold the same ``tensors``."""
    differs = 0
    for t in tensors:
        theirs = t.clone()
        dist.broadcast(theirs, src=group_src(group), group=group)
        differs |= int(not torch.equal(theirs, t))
    flag = torch.tensor([differs], device=tensors[0].device)
    dist.all_reduce(flag, group=group)
    if flag.item():
        raise ValueError(f"the ranks of a tensor-parallel group hold different batches ({int(flag.item())} of "
                         f"{dist.get_world_size(group)} differ from rank 0's): every rank of the group must see "
                         "the same token ids and targets; split the batch over data-parallel ranks instead")


def _tp_forward(self, idx, targets=None, kv_cache=None):
    """The model's forward on this rank; without targets, whole (B, T, V) logits on every rank."""
    group = self._tp_group.group
    if kv_cache is not None and self.sequence_parallel:
        raise ValueError("sequence_parallel=True cannot decode with a KV cache: a step feeds one token, which "
                         "cannot be split over tp_size ranks; shard the model without sequence_parallel")
    if not self._tp_batch_checked:  # once: the first batch tells whether the ranks are fed alike
        _check_same_batch([idx] if targets is None else [idx, targets], group)
        self._tp_batch_checked = True
    out = type(self).forward(self, idx, targets, kv_cache)
    return out if targets is not None else gather_from_tp(out, group)  # (B, T, V/t) -> (B, T, V)


class ParallelSwiGLU(nn.Module):
    """SwiGLU over this rank's d_ff / t columns: gate and up column-parallel behind one f (or one
    all-gather), down row-parallel; the parameters keep the model's names."""

    def __init__(self, mlp: SwiGLU, group, sequence_parallel: bool):
        super().__init__()
        self.dropout = mlp.dropout
        self.c_gate, self.c_fc = (ColumnParallelLinear(lin, group, sequence_parallel=sequence_parallel, name="d_ff")
                                  for lin in (mlp.c_gate, mlp.c_fc))
        self.c_proj = RowParallelLinear(mlp.c_proj, group, sequence_parallel=sequence_parallel, name="d_ff")

    def forward(self, x):
        gate, up = column_parallel(x, [self.c_gate, self.c_fc])  # 2 x (B, T, d_ff/t)
        x = self.c_proj(F.silu(gate) * up)  # (B, T, C), or (B, T/t, C) under sequence parallelism
        if self.training and self.dropout > 0:
            x = F.dropout(x, p=self.dropout, training=True)
        return x


def _shard_mlp(block: nn.Module, group, sp: bool) -> None:
    """GELU's c_fc (or SwiGLU's gate and up) column-parallel, c_proj row-parallel: d_ff split; a
    mixture of experts replicated (:mod:`.experts`)."""
    if isinstance(block.mlp, MoE):
        replicate_moe(block.mlp, group, sp)
        return
    if isinstance(block.mlp, SwiGLU):
        block.mlp = ParallelSwiGLU(block.mlp, group, sp)
        return
    block.mlp.c_fc = ColumnParallelLinear(block.mlp.c_fc, group, sequence_parallel=sp, name="d_ff")
    block.mlp.c_proj = RowParallelLinear(block.mlp.c_proj, group, sequence_parallel=sp, name="d_ff")


def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool = False, *,
                          init_sync: str | None = "check") -> nn.Module:
    """Shard ``model`` in place over ``group`` (``None``: the default group) and return it.

    Transforms what is present: ``wte``/``wpe`` (embedding), each of ``blocks``, ``ln_f``/``lm_head``
    (head; ``model.loss`` becomes the vocabulary-parallel loss). ``init_sync``: see ``INIT_SYNCS``;
    the first forward also checks that the ranks see the same batch. Needs dropout 0.
    """
    sp = check_bool("sequence_parallel", sequence_parallel)
    check_choice("init_sync", init_sync, INIT_SYNCS)
    t = check_group(group, "apply_tensor_parallel")[1]
    _check_shardable(model, t)
    _sync_initial_state(model, group, init_sync)
    wte, wpe = getattr(model, "wte", None), getattr(model, "wpe", None)
    lm_head, ln_f = getattr(model, "lm_head", None), getattr(model, "ln_f", None)
    for block in getattr(model, "blocks", []):
        block.attn = ParallelSelfAttention(block.attn, group, sp)
        _shard_mlp(block, group, sp)
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
        # instance attributes shadow GPT.loss and GPT.forward, which nn.Module's call runs
        model.loss = VocabParallelLoss(group, vocab_start=dist.get_rank(group) * model.lm_head.out_features)
        model.forward = types.MethodType(_tp_forward, model)
        model._tp_batch_checked = False
    if ln_f is not None and sp:
        _mark_sequence_parallel(ln_f)
    if sp:  # the partial gradients of what runs on sequence shards, summed at the end of backward
        model._sp_grad_sync = SequenceParallelGradSync(
            [p for p in model.parameters() if getattr(p, "sequence_parallel", False)], group)
    model.tp_size, model.sequence_parallel, model._tp_group = t, sp, GroupRef(group)
    return model
