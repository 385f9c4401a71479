"""Tensor parallelism's rules, torch-free: when sequence parallelism applies (Korthikanti et al. 2022).

``check_sequence_parallel`` is the one home of the rule; the run description
(``labkit.parallel.RunConfig.check``), the estimator and the sequence-parallel collectives call it.
"""

from __future__ import annotations

from ..validate import ArgumentError, check_int

__all__ = ["check_sequence_parallel"]


def check_sequence_parallel(sequence_parallel: bool, tp_size: int, seq_len: int) -> bool:
    """``sequence_parallel`` if it can run, else a ValueError naming what it needs: t > 1 (it splits
    the sequence over the tensor group) and t dividing ``seq_len``, the positions a rank holds
    (s / cp under context parallelism)."""
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel={sequence_parallel!r} must be a bool")
    check_int("tp_size", tp_size, 1)
    check_int("seq_len", seq_len, 1)
    if sequence_parallel and tp_size == 1:
        raise ArgumentError("sequence_parallel=True needs tp_size > 1 (it splits the sequence over the tensor "
                            "group)", "sp_tp")
    if sequence_parallel and seq_len % tp_size:
        raise ArgumentError(f"sequence length {seq_len} must be divisible by tp_size={tp_size} under sequence "
                            "parallelism: each rank holds seq_len / tp_size positions", "sp_seq",
                            seq_len=seq_len, tp_size=tp_size)
    return sequence_parallel
