"""Context parallelism (Chapter 10): the sequence sharded through attention itself.

``shard``: the contiguous and zigzag layouts (:func:`shard_sequence`, :func:`unshard_sequence`);
``ring``: ring attention (Liu et al. 2023) as an autograd Function over point-to-point sends;
``apply``: labkit's GPT trained on sequence shards (:func:`apply_context_parallel`); ``analytic``:
chunks, causal work, the ring's bytes and when they hide behind compute, what it keeps for
backward. ``analytic`` imports no torch, and ``import labkit.context_parallel`` loads the rest
only when it is first used.
"""

from __future__ import annotations

from .._lazy import lazy_exports
from .analytic import (LAYOUTS, attention_activation_fraction, block_flops, causal_pairs, check_cp_seq_len,
                       chunk_offsets, chunks_of_rank, computed_blocks, global_loss_bytes, hide_chunk_tokens,
                       ring_attention_saved_bytes, ring_bytes_per_layer, ring_step_flops, shard_rotary_bytes)

__all__ = ["LAYOUTS", "attention_activation_fraction", "block_flops", "causal_pairs", "check_cp_seq_len",
           "computed_blocks", "chunk_offsets", "chunks_of_rank", "hide_chunk_tokens", "ring_bytes_per_layer",
           "ring_step_flops", "ring_attention_saved_bytes", "shard_rotary_bytes", "global_loss_bytes",
           "shard_sequence", "unshard_sequence", "shard_positions", "RingAttention", "ring_attention",
           "check_ring_inputs", "apply_context_parallel", "ContextParallelGradSum", "check_cp_group",
           "context_parallel_inputs", "context_parallel_loss"]

# the torch side (shard, ring, apply) loads on first use
__getattr__, __dir__ = lazy_exports(__name__, {
    ".shard": ("shard_sequence", "unshard_sequence", "shard_positions"),
    ".ring": ("RingAttention", "ring_attention", "check_ring_inputs"),
    ".apply": ("apply_context_parallel", "ContextParallelGradSum", "check_cp_group", "context_parallel_inputs",
               "context_parallel_loss"),
})
