"""Time labkit.estimate: one estimate, and a planner-sized sweep of configurations.

    python scripts/bench_estimate.py

A calculator in a browser runs the same code, so a sweep of thousands of configurations must
take well under a second. Prints a table; asserts nothing (the tests do).
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

from labkit.estimate import serving_memory, training_memory


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sweep(shape: str = "llama-3-70b", n_gpus: int = 64, seq_len: int = 8192) -> int:
    """Every (t, p, N_d, b, ZeRO, recompute, SP) of ``shape`` on ``n_gpus``: the estimates made."""
    count = 0
    for t, p in itertools.product((1, 2, 4, 8), _divisors(80)):
        if n_gpus % (t * p):
            continue
        dims = SimpleNamespace(dp_size=n_gpus // (t * p), tp_size=t, pp_size=p, cp_size=1)
        for b, z, rc, sp in itertools.product((1, 2, 4, 8), (0, 1, 2, 3), ("none", "selective", "full"),
                                              (False, True)):
            if sp and t == 1:
                continue
            training_memory(shape, seq_len=seq_len, micro_batch=b, dims=dims, zero_stage=z, recompute=rc,
                            sequence_parallel=sp, num_microbatches=max(p, 8))
            count += 1
    return count


def main() -> None:
    dims = SimpleNamespace(dp_size=8, tp_size=8, pp_size=1, cp_size=1)
    start = time.perf_counter()
    est = training_memory("llama-3-70b", seq_len=8192, micro_batch=1, dims=dims, zero_stage=3,
                          recompute="selective", sequence_parallel=True)
    one = time.perf_counter() - start
    print("Llama-3-70B, 64 GPUs as dp 8 x tp 8 with SP, ZeRO-3, selective recomputation, 8K tokens:")
    print(est)
    print(serving_memory("llama-3-8b", gpu="a100-80gb"))
    start = time.perf_counter()
    n = sweep()
    took = time.perf_counter() - start
    print(f"\none estimate: {one * 1e6:.0f} us; a sweep of {n} configurations: {took * 1e3:.0f} ms "
          f"({took / n * 1e6:.0f} us each)")


if __name__ == "__main__":
    main()
