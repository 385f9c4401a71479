"""Peak memory and step time of every checkpointing policy on this machine.

    python scripts/bench_checkpoint.py                       # CUDA when present, else CPU
    python scripts/bench_checkpoint.py --device cpu --n-layer 8 --batch-size 4 --impl torch

For each policy it measures one forward and backward with labkit.memory.MemoryMeter (activations
kept at the end of forward, and the peak of activations + temporaries) beside the prediction of
labkit.checkpoint.checkpoint_activation_bytes, and on CUDA the caching allocator's peak above the
model states. Then it times training steps (the fastest of --steps rounds, policies in turns) and
prints each policy's step time relative to no checkpointing. The exit status is 1 if a measured
peak exceeds its prediction by more than --tolerance (on CPU the two agree exactly).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from labkit.checkpoint import IMPLS, apply_checkpointing, checkpoint_activation_bytes, plan_for_budget, recompute_flops
from labkit.data import batches
from labkit.device import pick_device, seed_everything
from labkit.memory import measure_forward_backward
from labkit.model import build_model, get_preset

MiB = 2**20


def measure_memory(model, batch):
    """(kept activations, peak of activations + temporaries, allocator peak above the start or None)."""
    report = measure_forward_backward(model, batch)
    allocator = None
    if report.allocator_peak_bytes is not None:
        allocator = report.allocator_peak_bytes - report.allocator_start_bytes
    return report.activations, report.peak_of("activations", "temporaries"), allocator


def one_step(model, opt, batch, device) -> float:
    """Seconds of one forward, backward and SGD step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    model(*batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def step_times(models, batch, steps: int, device) -> list[float]:
    """Fastest step of each model over ``steps`` rounds (after a warm-up round), taken in turns
    so that a busy moment of a shared machine slows every policy alike."""
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    times = [[] for _ in models]
    for _ in range(steps + 1):
        for model, opt, ts in zip(models, opts, times):
            ts.append(one_step(model, opt, batch, device))
    return [min(ts[1:]) for ts in times]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: CUDA when present")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--impl", choices=list(IMPLS), default="scratch")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (one step per policy each)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="allowed measured/predicted - 1")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    device = pick_device(args.device)
    overrides = {"n_layer": args.n_layer, "dropout": args.dropout}
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    cfg = get_preset(args.preset, **overrides)
    seed_everything(0)
    plain = build_model(cfg, device=device)
    batch = next(batches(args.batch_size, cfg.seq_len, device=device))
    b = args.batch_size
    none_peak = checkpoint_activation_bytes(cfg, "none", b, device_type=device.type).peak
    policies = [("none", {}), ("selective", {}), ("every_k", {"k": 2}), ("sqrt", {}), ("full", {}),
                ("budget 50%", {"plan": plan_for_budget(cfg, none_peak // 2, b, device_type=device.type)})]
    print(f"{args.preset} with L={cfg.n_layer}, h={cfg.d_model}, a={cfg.n_head}, s={cfg.seq_len}, b={b}, "
          f"dropout={cfg.dropout}, fp32 on {device.type} ({torch.get_num_threads()} threads), impl={args.impl}")
    header = (f"{'policy':<11} {'plan':<32} {'kept MiB':>9} {'peak MiB':>9} {'predicted':>9} "
              f"{'allocator':>9} {'recompute':>9} {'time':>6}")
    print(header)
    print("-" * len(header))
    rows, models, failures = [], [], 0
    for name, kw in policies:
        model = copy.deepcopy(plain)
        plan_or_policy = kw.pop("plan", None) or name
        plan = apply_checkpointing(model, plan_or_policy, impl=args.impl, **kw)
        kept, peak, allocator = measure_memory(model, batch)
        want = checkpoint_activation_bytes(cfg, plan, b, device_type=device.type)
        failures += peak > want.peak * (1 + args.tolerance)
        flops = recompute_flops(cfg, plan, b) / recompute_flops(cfg, "full", b)
        rows.append((name, plan, kept, peak, want.peak, allocator, flops))
        models.append(model)
    seconds = step_times(models, batch, args.steps, device)
    for (name, plan, kept, peak, predicted, allocator, flops), sec in zip(rows, seconds):
        print(f"{name:<11} {str(plan):<32} {kept / MiB:9.2f} {peak / MiB:9.2f} {predicted / MiB:9.2f} "
              f"{'-' if allocator is None else f'{allocator / MiB:9.2f}':>9} {flops:8.2f}x {sec / seconds[0]:5.2f}x")
    print("recompute: FLOPs recomputed per step, in forwards of all blocks; time: step time / no checkpointing")
    if failures:
        print(f"{failures} measured peak(s) exceed the prediction by more than {args.tolerance:.0%}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
