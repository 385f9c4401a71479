"""What the planner sweeps: the layouts (t, p, N_d) of a cluster and each layout's pipeline choices.

The formulas it needs come from where they live: memory from ``labkit.estimate``, the FLOPs of
a step from ``labkit.shapes``, the pipeline's bubble from ``labkit.pipeline.analytic`` (torch-free,
as the estimator uses it).
"""

from __future__ import annotations

from typing import NamedTuple

from ..estimate import training_memory
from ..pipeline.analytic import bubble_fraction

__all__ = ["Dims", "layouts", "pipeline_choices", "pipeline_bubble", "flops_of", "training_memory"]


class Dims(NamedTuple):
    """The degrees of one plan, as ``training_memory`` reads them (``ParallelDims``' fields)."""

    dp_size: int
    tp_size: int
    pp_size: int
    cp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape, num_gpus: int, gpus_per_node: int) -> list[tuple[int, int, int]]:
    """(t, p, N_d) with t p N_d = num_gpus: t divides n_head, n_kv_head, d_ff and gpus_per_node (a
    tensor group stays in a node); p is at most n_layer (stages of unequal layer counts when p does
    not divide it: the estimator sizes the most loaded)."""
    out = []
    for t in _divisors(shape.n_head):
        if shape.kv_heads % t or shape.ffn_dim % t or gpus_per_node % t or num_gpus % t:
            continue
        out += [(t, p, num_gpus // (t * p)) for p in _divisors(num_gpus // t) if p <= shape.n_layer]
    return out


def pipeline_choices(shape, p: int, dp: int, global_batch: int, micro_batches, interleave):
    """(b, m, v, schedule) for one layout: N_d b divides the global batch; v > 1 when p > 1, v p
    divides n_layer and p divides m (the interleaved schedule's condition)."""
    for b in micro_batches:
        if global_batch % (dp * b):
            continue
        m = global_batch // (dp * b)
        for v in interleave:
            if v == 1:
                yield b, m, 1, ("1f1b" if m >= p else "gpipe")
            elif p > 1 and shape.n_layer % (p * v) == 0 and m % p == 0:
                yield b, m, v, "interleaved"


def pipeline_bubble(p: int, m: int, schedule: str, v: int) -> float:
    """The idle fraction of a step (``labkit.pipeline``'s formula)."""
    return bubble_fraction(p, m, schedule, v)


def flops_of(shape, global_batch: int, recompute: bool = False) -> int:
    """Matmul FLOPs of a training step of ``global_batch`` sequences (``ModelShape.step_flops``, the
    count ``labkit.model.training_flops`` checks against a FLOP counter)."""
    return shape.step_flops(global_batch, recompute)
