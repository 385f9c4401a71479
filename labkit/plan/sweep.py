"""What the planner sweeps: the layouts (t, cp, p, N_d) of a cluster and each layout's pipeline choices.

The formulas it needs come from where they live: memory from ``labkit.estimate``, the FLOPs of
a step from ``labkit.shapes``, which interleavings run and their schedule from
``labkit.pipeline.analytic`` (torch-free, as the estimator uses it).
"""

from __future__ import annotations

from typing import NamedTuple

from ..context_parallel.analytic import check_cp_seq_len
from ..estimate import training_memory
from ..expert_parallel.analytic import check_ep_size
from ..moe.analytic import training_step_flops
from ..parallel.dims import ParallelDims
from ..pipeline.analytic import default_schedule, interleave_allowed
from ..validate import ArgumentError, check_int

__all__ = ["Dims", "CP_MIN_SEQ_LEN", "cp_degrees", "mla_cp_degrees", "ep_degrees", "layouts", "pipeline_choices", "flops_of",
           "training_memory"]

CP_MIN_SEQ_LEN = 16384  # the sequence length from which the planner weighs cp > 1 by default


class Dims(NamedTuple):
    """The degrees of one plan, as ``training_memory`` reads them (``ParallelDims``' fields)."""

    dp_size: int
    tp_size: int
    pp_size: int
    cp_size: int = 1
    ep_size: int = 1  # inside dp: it adds no rank

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_degrees(seq_len: int, num_gpus: int, context_parallel=None) -> tuple[int, ...]:
    """The context-parallel degrees the planner weighs. ``None``: 1, and when ``seq_len`` is at
    least ``CP_MIN_SEQ_LEN`` (16384) every power of two cp > 1 that divides ``num_gpus`` with
    2 cp dividing ``seq_len`` (the zigzag layout's chunks). Shorter sequences keep cp = 1: their
    activations fit without it, Llama 3 trained its 8K stage without it (Grattafiori et al. 2024,
    Table 4), and the step-time model, which lets the ring hide behind compute but not tensor
    parallelism's all-reduces, would trade t for cp there on that difference alone. A tuple:
    those degrees, each dividing ``num_gpus`` and 2 cp ``seq_len``."""
    if context_parallel is None:
        return (1,) + tuple(2 ** k for k in range(1, num_gpus.bit_length())
                            if seq_len >= CP_MIN_SEQ_LEN and num_gpus % 2 ** k == 0 and seq_len % 2 ** (k + 1) == 0)
    if not isinstance(context_parallel, (tuple, list)):
        raise TypeError(f"context_parallel={context_parallel!r} must be None or a tuple of degrees, e.g. (1, 2, 4)")
    degrees = tuple(context_parallel)
    if not degrees:
        raise ValueError("context_parallel=() must hold at least one degree")
    for cp in degrees:
        check_int("context_parallel", cp, 1)
        if num_gpus % cp:
            raise ValueError(f"context_parallel={degrees!r}: each degree must divide num_gpus={num_gpus}; "
                             f"{cp} does not")
        try:
            check_cp_seq_len(seq_len, cp, "zigzag")
        except ValueError as err:
            raise ValueError(f"context_parallel={degrees!r}: {err}") from None
    return tuple(sorted(set(degrees)))


def mla_cp_degrees(shape, cps: tuple, context_parallel) -> tuple:
    """``cps``, or (1,) for a model with MLA, whose ring attention labkit does not run (the
    estimate refuses it): a cp > 1 asked for is refused by name."""
    if not shape.kv_lora_rank or cps == (1,):
        return cps
    if context_parallel is not None:
        raise ArgumentError(f"context_parallel={tuple(context_parallel)!r} with MLA (kv_lora_rank={shape.kv_lora_rank}): "
                            "labkit's ring attention is CausalSelfAttention's; use (1,)")
    return (1,)


def ep_degrees(shape, dp: int, expert_parallel=None) -> tuple[int, ...]:
    """The expert-parallel degrees the planner weighs on ``dp`` data-parallel ranks: those of
    ``expert_parallel`` (None: every degree) that divide both dp and the routed experts E
    (``ParallelDims``: ep divides dp; ``check_ep_size``: ep divides E). A dense model: (1,)."""
    degrees = _divisors(shape.n_experts or 1) if expert_parallel is None else check_ep_degrees(shape, expert_parallel)
    return tuple(ep for ep in degrees if _ep_fits(dp, ep))


def _ep_fits(dp: int, ep: int) -> bool:
    """Whether ``ParallelDims`` takes ep inside dp (its rule: ep divides dp_size)."""
    try:
        ParallelDims(dp_size=dp, ep_size=ep)
    except ValueError:
        return False
    return True


def check_ep_degrees(shape, expert_parallel) -> tuple[int, ...]:
    """``expert_parallel`` (a tuple of degrees) checked: each an int >= 1 dividing E (1 alone for a
    dense model), else a ValueError naming it."""
    if not isinstance(expert_parallel, (tuple, list)) or not expert_parallel:
        raise TypeError(f"expert_parallel={expert_parallel!r} must be None or a non-empty tuple of degrees, "
                        "e.g. (1, 8)")
    for ep in expert_parallel:
        check_int("expert_parallel", ep, 1)
        if ep > 1 and not shape.n_experts:
            raise ValueError(f"expert_parallel={tuple(expert_parallel)!r}: ep={ep} shards experts, and this "
                             "model has none; use 1")
        if ep > 1:
            check_ep_size(ep, shape.n_experts)
    return tuple(sorted(set(expert_parallel)))


def layouts(shape, num_gpus: int, gpus_per_node: int, even_stages: bool = False) -> list[tuple[int, int, int]]:
    """(t, p, N_d) with t p N_d = num_gpus: t divides n_head, n_kv_head, d_ff and gpus_per_node (a
    tensor group stays in a node); p is at most n_layer (stages of unequal layer counts when p does
    not divide it: the estimator sizes the most loaded; ``even_stages``: p divides n_layer). With
    experts, t = 1: the estimate does not model experts under tensor parallelism (labkit keeps them whole on each tp rank);
    with MLA, t = 1: labkit's tensor parallelism splits ``CausalSelfAttention`` only."""
    out = []
    for t in _divisors(shape.n_head):
        if (shape.kv_heads % t or shape.ffn_dim % t or gpus_per_node % t or num_gpus % t
                or ((shape.n_experts or shape.kv_lora_rank) and t > 1)):
            continue
        out += [(t, p, num_gpus // (t * p)) for p in _divisors(num_gpus // t)
                if p <= shape.n_layer and not (even_stages and shape.n_layer % p)]
    return out


def pipeline_choices(shape, p: int, dp: int, global_batch: int, micro_batches, interleave, even_stages=False):
    """(b, m, v, schedule) for one layout: N_d b divides the global batch; v > 1 where
    ``labkit.pipeline.analytic.interleave_allowed`` says it runs (``even_stages``: and the v p
    chunks are equal); the schedule is ``default_schedule``'s."""
    for b in micro_batches:
        if global_batch % (dp * b):
            continue
        m = global_batch // (dp * b)
        for v in interleave:
            if interleave_allowed(shape.n_layer, p, m, v) and not (even_stages and shape.n_layer % (p * v)):
                yield b, m, v, default_schedule(p, m, v)


def flops_of(shape, global_batch: int, recompute: bool = False) -> int:
    """Matmul FLOPs of a training step of ``global_batch`` sequences (``labkit.moe.analytic.
    training_step_flops``, the count ``labkit.model.training_flops`` checks against a FLOP counter;
    with experts, a token's active ones)."""
    return training_step_flops(shape, global_batch, recompute)
