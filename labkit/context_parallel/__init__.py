"""Context parallelism (Chapter 10): the sequence sharded through attention itself.

``shard``: the contiguous and zigzag layouts (:func:`shard_sequence`, :func:`unshard_sequence`);
``ring``: ring attention (Liu et al. 2023) as an autograd Function over point-to-point sends;
``apply``: labkit's GPT trained on sequence shards (:func:`apply_context_parallel`); ``analytic``:
chunks, causal work, the ring's bytes and when they hide behind compute. ``analytic`` imports no
torch, and ``import labkit.context_parallel`` loads the rest only when it is first used.
"""

from __future__ import annotations

import importlib

from .analytic import (LAYOUTS, attention_activation_fraction, block_flops, causal_pairs, check_cp_seq_len, computed_blocks,
                       chunk_offsets, chunks_of_rank, hide_chunk_tokens, ring_bytes_per_layer)

_LAZY = {"shard_sequence": "shard", "unshard_sequence": "shard", "shard_positions": "shard",
         "RingAttention": "ring", "ring_attention": "ring", "check_ring_inputs": "ring",
         "apply_context_parallel": "apply", "ContextParallelGradSum": "apply", "check_cp_group": "apply"}

__all__ = ["LAYOUTS", "attention_activation_fraction", "block_flops", "causal_pairs", "check_cp_seq_len", "computed_blocks",
           "chunk_offsets", "chunks_of_rank", "hide_chunk_tokens", "ring_bytes_per_layer", *_LAZY]


def __getattr__(name: str):
    """Load the torch side (shard, ring, apply) on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
