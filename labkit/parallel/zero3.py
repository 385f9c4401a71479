"""ZeRO-3 under the pipeline, sequence parallelism and recomputation (and ZeRO-2's sum over "tp"),
and the ranks ZeRO shards over (:func:`replica_group`): what :func:`parallelize_gpt` adds around
:class:`labkit.zero.FullyShardedModule`.

ZeRO shards over the ranks that hold the same parameters: "dp", or with context parallelism the
dp x cp ranks (each rank's gradient then cp times its share of the sequence, so ZeRO's mean sums
the shares). Under a pipeline each of a rank's chunks is wrapped on its own: the schedule calls the
wrapper, so every unit (each block; the token embedding on the first stage, the output projection
on the last) is gathered around the chunk's forward and again in its backward, and each backward
pass reduce-scatters its gradients, which accumulate in the shards over the m micro-batches.
The tied embedding is a unit of one parameter at both ends, flattened and padded alike and
sharded over same-size groups: a rank's shard at the first stage and its peer's at the last
cover the same elements, so the pipeline's exchange sums the two shards' gradients.

Under sequence parallelism a rank's gradient of a sequence-sharded parameter (norms, row-parallel
biases, position embeddings) is a partial sum over "tp". A unit's layout is the same on every
tensor-parallel rank, so the shards line up over "tp" too, and by linearity summing the
reduce-scattered shards over "tp" equals reduce-scattering the summed gradient:
:class:`ShardedSequenceSum` does it once per step, after the step's last backward pass.

Under recomputation a checkpointed block's forward runs again in backward, without the unit's
hooks: :class:`BlockShards` lets ``apply_checkpointing`` gather the unit around it again.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..zero import FullyShardedModule

__all__ = ["BlockShards", "ShardedSequenceSum", "replica_group", "shard_chunks", "sharded_full_state"]


def replica_group(dims, mesh, coords):
    """The ranks that hold this rank's parameters, which ZeRO shards over: the dp x cp ranks at its
    (pp, tp), as the estimator counts them (``RunConfig.replicas``); "dp"'s group when cp = 1. Every
    rank creates every such group, in one order (``new_group`` is collective)."""
    if dims.cp_size == 1:
        return mesh.get_group("dp")
    mine = None
    for pp in range(dims.pp_size):
        for tp in range(dims.tp_size):
            ranks = [dims.rank_of(dp=d, pp=pp, cp=c, tp=tp) for d in range(dims.dp_size) for c in range(dims.cp_size)]
            group = dist.new_group(ranks)  # group rank d cp + c: the same order at every (pp, tp)
            if (pp, tp) == (coords.pp, coords.tp):
                mine = group
    return mine


def shard_chunks(model, chunks, group, is_block, unit_groups=None):
    """Each of ``chunks`` in a :class:`FullyShardedModule` over ``group``, its blocks (``is_block``),
    token embedding and output projection as units (``unit_groups``: the wrapper's). Returns the
    wrappers and the tied weight's shard parameter (None on a middle stage or with untied
    embeddings). Each wrapper keeps ``sequence_parallel_names`` and ``model_names`` ({its
    parameter's name: the model's name})."""
    model_name = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        model_name.setdefault(id(p), n)  # a tied weight answers to its first name
    wrapped, tied = [], None
    for chunk in chunks:
        ends = {id(m) for m in (getattr(chunk, "wte", None), getattr(chunk, "lm_head", None)) if m is not None}
        named = list(chunk.named_parameters())
        fsdp = FullyShardedModule(chunk, group=group, unit_groups=unit_groups,
                                  unit_types=lambda m, ends=ends: is_block(m) or id(m) in ends)
        fsdp.sequence_parallel_names = {n for n, p in named if getattr(p, "sequence_parallel", False)}
        fsdp.model_names = {n: model_name[id(p)] for n, p in named}
        wrapped.append(fsdp)
        if chunk.tied_embeddings and (chunk.first or chunk.last):
            key = "wte.weight" if chunk.first else "lm_head.weight"
            tied = next(s for name, _, _, s in fsdp.shard_entries() if name == key)
    return wrapped, tied


class BlockShards:
    """ZeRO-3's gather of a block, whichever of ``wrappers`` holds it, for activation checkpointing
    (``apply_checkpointing(..., sharded=...)``): a recomputed block gathers its unit again. A block
    no wrapper holds (another pipeline stage's) keeps its own parameters."""

    def __init__(self, wrappers):
        self.wrappers = list(wrappers)

    def _holder(self, block):
        return next((w for w in self.wrappers if w.is_unit(block)), None)

    def gathered(self, block):
        w = self._holder(block)
        return contextlib.nullcontext() if w is None else w.gathered(block)

    def unit_parameters(self, block) -> list:
        w = self._holder(block)
        return list(block.parameters()) if w is None else w.unit_parameters(block)


def sequence_sharded(wrappers) -> list:
    """The shard parameters, in a fixed order, of the wrappers' sequence-sharded parameters."""
    return [s for w in wrappers for name, _, _, s in w.shard_entries() if name in w.sequence_parallel_names]


class ShardedSequenceSum:
    """Sums over ``group`` ("tp") the gradients the step added to ``shards`` (the sequence-sharded
    parameters' shards under ZeRO-2 or ZeRO-3, laid out alike on every rank of "tp"): :meth:`begin`
    before the step's first backward pass, :meth:`finish` after its last; gradients accumulated
    over earlier steps stay as they were. A shard without a gradient counts as zeros."""

    def __init__(self, shards, group):
        self.shards, self.group, self._before = list(shards), group, None

    def begin(self) -> None:
        self._before = [None if s.grad is None else s.grad.detach().clone() for s in self.shards]

    @torch.no_grad()
    def finish(self) -> None:
        if self.shards:  # every rank of "tp" holds the same shards, in the same order
            mine = [torch.zeros_like(s) if s.grad is None else s.grad if b is None else s.grad - b
                    for s, b in zip(self.shards, self._before)]
            flat = torch.cat([g.reshape(-1) for g in mine])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for s, b in zip(self.shards, self._before):
                total = flat[offset:offset + s.numel()].view_as(s).clone()
                offset += s.numel()
                if s.grad is not None or bool(total.any()):
                    s.grad = total if b is None else b + total
        self._before = None


def sharded_full_state(wrappers) -> dict:
    """{the model's parameter name: its full value} of the wrapped chunks, gathered over "dp"."""
    out = {}
    for w in wrappers:
        state = w.full_state_dict()
        out.update({w.model_names[n]: state[n] for n in w.model_names})
    return out
