"""Context parallelism under the pipeline: what :func:`parallelize_gpt` adds around each chunk.

A stage's chunk of a context-parallel GPT runs its layers as the model's own forward does
(:func:`labkit.context_parallel.context_parallel_inputs`): the first stage embeds the shard's ids
at their global positions, every block attends by the ring over "cp" (rotary angles at the global
positions), and the messages between stages carry this rank's s/cp positions (s/(cp t) under
sequence parallelism), so each stage's ranks of "cp" exchange with their own peers of "pp". The
last stage's loss is the context-parallel one: the global mean's value, this rank's share's gradient.
"""

from __future__ import annotations

from functools import partial

from ..context_parallel import context_parallel_inputs, context_parallel_loss

__all__ = ["context_parallel_chunks", "context_parallel_loss_fn"]


def _chunk_forward(chunk, model, factor, x):
    """ids (B, s/cp) (first stage) or x (B, s/cp / factor, C) -> x of that shape, or logits (B, s/cp, V/t)."""
    shard_len = x.size(1) if chunk.first else x.size(1) * factor  # s/cp tokens on this rank
    pos, attend, rope_pos = context_parallel_inputs(model, shard_len, x.device)
    if chunk.first:
        x = model.embed(x, pos)  # (B, s/cp, C), or (B, s/(cp t), C) under sequence parallelism
    for block in chunk.blocks:
        x = block(x, attend, rope_pos)
    return model.head(x) if chunk.last else x


def context_parallel_chunks(model, chunks, sequence_factor: int) -> None:
    """Make each of ``chunks`` (``labkit.pipeline.StageChunk``) of the context-parallel ``model`` run
    its layers by the ring, in place. ``sequence_factor``: t under sequence parallelism, else 1 (the
    activations stages exchange hold 1/t of a rank's s/cp tokens)."""
    for chunk in chunks:
        chunk.forward = partial(_chunk_forward, chunk, model, sequence_factor)  # shadows StageChunk.forward


def context_parallel_loss_fn(model):
    """The last stage's ``loss_fn(logits, targets)`` for the pipeline runtime."""
    return partial(context_parallel_loss, model)
