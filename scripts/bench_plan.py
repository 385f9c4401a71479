"""The planner against the published runs the book cites, and the speed of its sweep.

    python scripts/bench_plan.py [--efficiency 0.5]

Prints, for BLOOM-176B, Llama 3 405B at 8K and 128K tokens and the ten rows of Narayanan et
al.'s Table 1, each described as it ran (``labkit.plan.published``: the settings, the sources and
what the model leaves out), the step-time model's TFLOP/s a GPU beside the published figure
(counted as the source counts it) and the error, the estimator's memory a GPU beside the
reported one where there is one, and the time of a sweep of 10^4 configurations (a calculator in
a browser runs the same code). Asserts nothing: the tests do.
"""

from __future__ import annotations

import argparse
import time

from labkit.plan import plan_training
from labkit.plan.published import NARAYANAN_TABLE1, PUBLISHED, model_run, narayanan_run
from labkit.shapes import PRESETS


def _line(r: dict) -> str:
    mem = (f"{r['memory_gb']:6.1f} GB vs {r['published_memory_gb']:.0f} ({r['memory_error']:+.0%})"
           if r["published_memory_gb"] else f"{r['memory_gb']:6.1f} GB{'' if r['fits'] else ' (does not fit)'}")
    return (f"{r['name']:<20} {r['tflops']:6.0f} vs {r['published_tflops']:5.0f} TFLOP/s ({r['tflops_error']:+6.1%})"
            f"  bubble {r['bubble']:5.1%}  {mem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--efficiency", type=float, default=0.5, help="share of the dense peak (default 0.5)")
    args = parser.parse_args()
    print("Published runs, as they ran (model vs published; TFLOP/s as each source counts them):")
    for case in PUBLISHED.values():
        print(_line(model_run(case, args.efficiency)))
        for note in case.notes:
            print(f"    note: {note}")
    print("\nNarayanan et al. 2021b, Table 1 (full recomputation, scatter/gather, b = 1 assumed):")
    errors = []
    for row in NARAYANAN_TABLE1:
        best = max((model_run(narayanan_run(row, v), args.efficiency) for v in (1, 2)
                    if v == 1 or row[5] > 1), key=lambda r: r["tflops"])
        errors.append(best["tflops_error"])
        print(_line(best))
    print(f"  error from {min(errors):+.1%} to {max(errors):+.1%}")
    t0 = time.perf_counter()
    found = plan_training(PRESETS["llama-3-70b"], gpu="h100-sxm", num_gpus=1024, seq_len=8192, global_batch=1024,
                          micro_batches=(1, 2, 4, 8), interleave=(1, 2, 4))
    seconds = time.perf_counter() - t0
    print(f"\nsweep: {found.considered:,} configurations sized in {seconds:.2f} s "
          f"({found.considered / seconds:,.0f} a second; {sum(found.refused.values()):,} refused unsized)")


if __name__ == "__main__":
    main()
