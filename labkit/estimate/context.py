"""What context parallelism changes in the training estimate's activations, term by term.

Torch-free. With cp > 1 a rank holds s/cp tokens (the estimator's s) and every attention layer
runs labkit's ring (``labkit.context_parallel.RingAttention``) whatever ``attention`` says: a
flash-style kernel, which never keeps an (s, s) block and keeps its output O and a fp32
log-sum-exp instead, so "eager" and "flash" are one count (:func:`core_under_cp`). For labkit's
Llama block the ring's tensors (``labkit.context_parallel.analytic.ring_attention_saved_bytes``)
replace the core's terms, and the shard's global positions add a rotary gather per layer, the
positions every checkpointed block keeps under full recomputation, and the global loss's counts.
GPT-2's block (Korthikanti et al.'s formula) and fused kernels: their own flash count.
"""

from __future__ import annotations

from ..context_parallel.analytic import global_loss_bytes, ring_attention_saved_bytes, shard_rotary_bytes
from ..validate import check_int

__all__ = ["core_under_cp", "ring_layer_terms", "cp_micro_batch_bytes"]

# the Llama block's core terms (llama_layer_bytes' names), which the ring's replace
_CORE = ("keys for", "values for", "softmax output", "attention output O", "log-sum-exp")


def core_under_cp(attention: str, cp_size: int) -> str:
    """The kernel the count takes: ``attention``, or "flash" when cp > 1 (the ring is flash-style)."""
    return "flash" if check_int("cp_size", cp_size, 1) > 1 else attention


def ring_layer_terms(terms: dict, shape, seq_len: int, micro_batch: int, tp_size: int, *, dtype_bytes: int,
                     recompute: str) -> dict:
    """labkit's Llama block's ``terms`` (``llama_layer_bytes``') on a context-parallel rank: the
    core's replaced by what the ring keeps. Its q is the block's rotated q (that term already);
    its k the rotated k, a storage of its own (n_kv heads, not repeated); its v a view of the qkv
    projection's output, which stays whole ((a + 2 n_kv) hd s b e); then O and L (none) and, with
    rotary positions, :func:`~labkit.context_parallel.analytic.shard_rotary_bytes`. Full: ``terms``."""
    if recompute == "full":
        return terms
    a, kv = shape.n_head // tp_size, shape.kv_heads // tp_size
    ring = ring_attention_saved_bytes(seq_len, micro_batch, a, kv, shape.head_dim, dtype_bytes=dtype_bytes,
                                      recompute=recompute)
    kept = {k: v for k, v in terms.items() if not k.startswith(_CORE)}
    kept["ring's k, the rotated k (n_kv hd s b e / t)"] = ring.pop("k (n_kv hd s b e)")
    v = ring.pop("v (n_kv hd s b e)")  # a view of the qkv output, whose a + 2 n_kv heads stay whole
    kept["ring's v: the qkv output it views ((a + 2 n_kv) hd s b e / t)"] = v // kv * (a + 2 * kv)
    del ring["q (a hd s b e)"]  # the rotated q
    kept.update({f"ring's {name}": value for name, value in ring.items()})  # O and L unless recomputed
    if shape.pos == "rope":
        kept["rotary cos and sin at the shard's positions (s hd e)"] = shard_rotary_bytes(seq_len, shape.head_dim,
                                                                                           dtype_bytes)
    return kept


def cp_micro_batch_bytes(shape, run, stage: int, seq_len: int) -> int:
    """Bytes a rank of pipeline ``stage`` keeps per micro-batch under context parallelism beyond its
    layers, embedding and head: under full recomputation with rotary positions, the shard's global
    positions (int64, 8 s/cp: one tensor every checkpointed block of the chunk keeps as its input);
    on the last stage, :func:`~labkit.context_parallel.analytic.global_loss_bytes`. 0 without cp."""
    if run.cp_size == 1:
        return 0
    positions = 8 * seq_len if run.recompute == "full" and shape.pos == "rope" else 0
    return positions + (global_loss_bytes(run.tp_size) if stage == run.pp_size - 1 else 0)
