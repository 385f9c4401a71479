"""labkit.estimate against measurement, and its speed.

    python scripts/bench_estimate.py [--fake-layers N] [--no-grid]

Prints (1) the estimator's error against labkit's memory meter on the real model in one process
on the CPU (Llama blocks with n_kv = a, a/2, 1; b = 1, 2; fp32 and bf16), and on gloo ranks over
tests/test_estimate_grid.py's grid of composed runs (8 and 4 ranks, ~1 minute; each stage's
ranks measure alike, so one row a stage; GPT-2's block shows Korthikanti's GPU formula against
the CPU's tensors), (2) against PyTorch's
MemTracker on one rank of Llama-2-7B (tp 2, with SP, tp 2 x pp 2) and of Llama-2-70B (tp 8) traced
under FakeTensorMode with torch's fake process group (N layers, default 4; 32 takes minutes), and (3) the time of
one estimate and of a planner-sized sweep (a calculator in a browser runs the same code, so
thousands of configurations must take well under a second). Asserts nothing: the tests do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from labkit.estimate import ModelShape, serving_memory, training_memory
from labkit.shapes import preset

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("params", "grads", "optimizer", "activations")


def _row(name: str, measured: dict, est, counters: int) -> str:
    """One table row: each part's error in bytes and in percent (the step counters of torch's
    Adam, 4 bytes a tensor on the host on a GPU, are added to the estimate's optimizer)."""
    want = {**{k: getattr(est, k) for k in FIELDS}, "optimizer": est.optimizer + counters}
    cells = [f"{measured[k] - want[k]:+d} B ({100 * (measured[k] / want[k] - 1):+.3f}%)" if want[k] else "-"
             for k in FIELDS]
    return f"{name:<34}" + "".join(f"{c:>26}" for c in cells)


def meter_rows() -> list[str]:
    """The estimator against labkit's memory meter, one process, CPU."""
    import torch

    from labkit.memory import measure_forward_backward, measure_step
    from labkit.model import GPTConfig, build_model
    from labkit.precision import make_optimizer

    rows = []
    for kv, b, (dtype, precision, policy) in itertools.product(
            (4, 2, 1), (1, 2), ((torch.float32, "fp32", "fp32"), (torch.bfloat16, "bf16-mixed", "mixed"))):
        cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=kv, d_ff=96, vocab_size=128, seq_len=16,
                        norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, bias=False)
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        batch = tuple(torch.randint(128, (b, 16), generator=gen) for _ in range(2))
        model = build_model(cfg, dtype=dtype)
        acts = measure_forward_backward(model, batch).activations
        states = measure_step(model, make_optimizer(model.parameters(), policy, "adamw", lr=1e-3), batch)
        got = {"params": states.max_by_category["parameters"], "grads": states.max_by_category["gradients"],
               "optimizer": states.max_by_category["optimizer"], "activations": acts}
        est = training_memory(ModelShape.from_config(cfg), seq_len=16, micro_batch=b, precision=precision)
        rows.append(_row(f"meter: n_kv={kv} b={b} {precision}", got, est, 4 * len(list(model.parameters()))))
    return rows


def grid_rows() -> list[str]:
    """The estimator against the meter on real ranks: tests/test_estimate_grid.py's cases, one row
    per pipeline stage (its ranks measure alike; the test checks every rank)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_estimate_grid as grid  # the test's cases, launches and estimate

    runs, rows = grid.launch_grid(), []
    for i, (family, degrees, kw) in enumerate(grid.CASES):
        by_stage = {got["stage"]: got for got in grid.ranks(runs, i)}
        for stage, got in sorted(by_stage.items()):
            name = f"{grid.SIZES[i]}r {family} {'x'.join(map(str, degrees))} z{kw.get('zero_stage', 0)} " \
                   f"{kw.get('checkpoint', 'none')[:3]}{' SP' if kw.get('sequence_parallel') else ''} s{stage}"
            rows.append(_row(name, got, grid.estimate(grid.CASES[i], stage=stage), got["step_counters"]))
    return rows


def fake_rows(n_layer: int) -> list[str]:
    """The estimator against MemTracker on one fake rank (tests/test_estimate_fake.py)."""
    rows = []
    for name, tp, pp, sp in (("llama-2-7b", 2, 1, 0), ("llama-2-7b", 2, 1, 1), ("llama-2-7b", 2, 2, 0),
                             ("llama-2-70b", 8, 1, 0)):
        out = subprocess.run([sys.executable, str(ROOT / "tests" / "test_estimate_fake.py"), name, str(n_layer),
                              str(tp), str(pp), str(sp)], capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
        if out.returncode:
            rows.append(f"fake tp={tp} pp={pp}: failed: {out.stderr.strip().splitlines()[-1]}")
            continue
        got = json.loads(out.stdout.strip().splitlines()[-1])
        dims = SimpleNamespace(dp_size=1, tp_size=tp, pp_size=pp, cp_size=1)
        est = training_memory(preset(name).replace(n_layer=n_layer), seq_len=4096, micro_batch=1,
                              dims=dims, precision="bf16", num_microbatches=2 * pp, sequence_parallel=bool(sp))
        rows.append(_row(f"fake: {name} L={n_layer} tp={tp}{' SP' if sp else ''} pp={pp}", got, est,
                         4 * got["n_tensors"]))
    return rows


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sweep(shape: str = "llama-3-70b", n_gpus: int = 64, seq_len: int = 8192) -> int:
    """Every (t, p, N_d, b, ZeRO, recompute, SP) of ``shape`` on ``n_gpus``: the estimates made."""
    count = 0
    for t, p in itertools.product((1, 2, 4, 8), _divisors(80)):
        if n_gpus % (t * p):
            continue
        dims = SimpleNamespace(dp_size=n_gpus // (t * p), tp_size=t, pp_size=p, cp_size=1)
        for b, m, z, rc, sp in itertools.product((1, 2, 4, 8), (8, 32), (0, 1, 2, 3),
                                                 ("none", "selective", "full"), (False, True)):
            if sp and t == 1:
                continue
            training_memory(shape, seq_len=seq_len, micro_batch=b, dims=dims, zero_stage=z, recompute=rc,
                            sequence_parallel=sp, num_microbatches=max(p, m))
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fake-layers", type=int, default=4, help="Llama-2-7B layers to trace (0: skip)")
    parser.add_argument("--no-grid", action="store_true", help="skip the grid on gloo ranks")
    args = parser.parse_args()
    print(f"{'case':<34}" + "".join(f"{k + ' error':>26}" for k in FIELDS))
    for row in (meter_rows() + ([] if args.no_grid else grid_rows())
                + (fake_rows(args.fake_layers) if args.fake_layers > 0 else [])):
        print(row)
    print()
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
