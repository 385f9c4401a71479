"""Peak memory and time of one accumulation window against the micro-batch size (Chapter 4).

    python scripts/bench_accumulation.py                       # tiny GPT, global batch 16, on CPU or CUDA
    python scripts/bench_accumulation.py --preset gpt2-small --seq-len 512 --global-batch 32

For each micro-batch size b dividing the global batch: the measured peak of a steady-state
window (labkit.accumulate.measure_microbatch), the prediction model states + activations, and
the wall time of one window of k = B / b micro-steps with AdamW.
"""

from __future__ import annotations

import argparse
import time

import torch

from labkit.accumulate import accumulation_step, measure_microbatch
from labkit.device import pick_device
from labkit.memory import activation_bytes, model_state_bytes
from labkit.model import build_model, get_preset


def bench(preset: str, seq_len: int, global_batch: int, repeats: int, device: torch.device) -> list[dict]:
    cfg = get_preset(preset, seq_len=seq_len)
    torch.manual_seed(0)
    model = build_model(cfg, device=device)
    params = list(model.parameters())
    states = model_state_bytes(sum(p.numel() for p in params), "fp32", "adamw", n_tensors=len(params)).total
    make_adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    optimizer = make_adamw(model.parameters())
    x = torch.randint(cfg.vocab_size, (global_batch, seq_len), device=device)  # (B, T)
    y = torch.randint(cfg.vocab_size, (global_batch, seq_len), device=device)  # (B, T)
    rows = []
    for b in [b for b in range(1, global_batch + 1) if global_batch % b == 0]:
        report = measure_microbatch(model, make_adamw, b, seq_len)
        k = global_batch // b
        accumulation_step(model, optimizer, x, y, k)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            accumulation_step(model, optimizer, x, y, k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rows.append({"b": b, "k": k, "peak": report.peak_bytes, "activations": report.activations,
                     "predicted": states + activation_bytes(cfg, b, seq_len, device_type=device.type).total,
                     "ms": (time.perf_counter() - start) / repeats * 1e3})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    rows = bench(args.preset, args.seq_len, args.global_batch, args.repeats, device)
    print(f"{args.preset}, seq_len {args.seq_len}, global batch {args.global_batch}, {device.type}")
    print(f"{'b':>4} {'k':>4} {'peak MiB':>10} {'predicted':>10} {'activ. MiB':>11} {'ms/window':>10} {'vs b=B':>7}")
    full = rows[-1]["ms"]
    for r in rows:
        print(f"{r['b']:>4} {r['k']:>4} {r['peak'] / 2**20:>10.1f} {r['predicted'] / 2**20:>10.1f} "
              f"{r['activations'] / 2**20:>11.1f} {r['ms']:>10.1f} {r['ms'] / full:>6.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
