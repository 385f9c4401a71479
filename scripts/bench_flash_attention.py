"""FlashAttention (Chapter 7): speed against SDPA on a GPU; memory and correctness on a CPU.

    python scripts/bench_flash_attention.py              # CUDA when present, else CPU
    python scripts/bench_flash_attention.py --device cpu --lengths 256 512 1024

On a GPU: TFLOP/s of labkit's Triton kernels (FlashAttentionTriton) and of SDPA restricted to its
FlashAttention backend, forward and forward + backward, bf16, for each sequence length s, head dim
d (64 and 128) and causal or not, with b s = 16k tokens and h = 2048 (FlashAttention-2's setting).
FLOPs: 4 b a s^2 d forward, 2.5 times that backward, halved when causal. The target is at least
0.8x SDPA's forward on an H100-class GPU; the exit status is 1 if a kernel's output differs from SDPA's.
On a CPU: the memory meter's peak of forward + backward for FlashAttention (PyTorch tiles) and
standard attention, with fitted exponents, and the Triton kernels run under the interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available() or "--device" in sys.argv and "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from labkit.device import pick_device, seed_everything  # noqa: E402
from labkit.flash_attention import flash_attention, standard_attention  # noqa: E402
from labkit.memory import MemoryMeter  # noqa: E402

MiB = 2**20


def cuda_time(fn, iters: int) -> float:
    """Median seconds of fn() over iters runs, after warm-up, timed with CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def bench_gpu(args, device) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from labkit.flash_attention import FlashAttentionTriton

    print(f"device: {torch.cuda.get_device_name(device)}, bf16, b s = {args.tokens} tokens, h = 2048")
    print(f"{'s':>6} {'d':>4} {'causal':>6} | {'fwd TFLOP/s ours':>16} {'SDPA':>6} {'ratio':>6} | "
          f"{'fwd+bwd ours':>12} {'SDPA':>6} {'ratio':>6} | max |O - O_sdpa|")
    failures = 0
    for d in args.head_dims:
        for s in args.lengths:
            for causal in (False, True):
                b, a = max(1, args.tokens // s), 2048 // d
                q, k, v = (torch.randn(b, a, s, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                dout = torch.randn_like(q)
                flops = 4 * b * a * s * s * d / (2 if causal else 1)

                def ours():
                    return FlashAttentionTriton.apply(q, k, v, causal)[0]

                def sdpa():
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                err = (ours() - sdpa()).abs().max().item()
                failures += err > 0.05  # bf16 outputs of size ~1: a few units in the last place
                res = {}
                for name, fn in (("ours", ours), ("sdpa", sdpa)):
                    with torch.no_grad():
                        fwd = cuda_time(fn, args.iters)
                    both = cuda_time(lambda: torch.autograd.grad(fn(), (q, k, v), dout), args.iters)
                    res[name] = (flops / fwd / 1e12, 3.5 * flops / both / 1e12)
                (of, ob), (sf, sb) = res["ours"], res["sdpa"]
                print(f"{s:>6} {d:>4} {causal!s:>6} | {of:>16.1f} {sf:>6.1f} {of / sf:>6.2f} | "
                      f"{ob:>12.1f} {sb:>6.1f} {ob / sb:>6.2f} | {err:.1e}")
                del q, k, v, dout
                torch.cuda.empty_cache()
    return int(failures > 0)


def peak_bytes(fn, s: int, d: int, device) -> int:
    g = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(1, 1, s, d, generator=g).to(device).requires_grad_() for _ in range(3))
    dout = torch.randn(1, 1, s, d, generator=g).to(device)
    with MemoryMeter() as meter:
        with meter.phase("forward"):
            out = fn(q, k, v)
        with meter.phase("backward"):
            out.backward(dout)
            del out
    return meter.report().peak_bytes


def bench_cpu(args, device) -> int:
    d = 64
    print(f"device: cpu; memory of one head's forward + backward (d = {d}, fp32, causal), memory meter")
    peaks = {"FlashAttention": [], "standard": []}
    print(f"{'s':>6} {'FlashAttention (MiB)':>21} {'standard (MiB)':>15} {'ratio':>6}")
    for s in args.cpu_lengths:
        peaks["FlashAttention"].append(peak_bytes(
            lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=64, block_k=64), s, d, device))
        peaks["standard"].append(peak_bytes(lambda q, k, v: standard_attention(q, k, v, True), s, d, device))
        f, st = peaks["FlashAttention"][-1], peaks["standard"][-1]
        print(f"{s:>6} {f / MiB:>21.2f} {st / MiB:>15.2f} {st / f:>6.1f}")
    for name, p in peaks.items():
        print(f"{name}: peak ~ s^{np.polyfit(np.log(args.cpu_lengths), np.log(p), 1)[0]:.2f}")

    from labkit.flash_attention import FlashAttentionTriton  # interpreted: TRITON_INTERPRET=1 above

    failures = 0
    print("Triton kernels under the interpreter and SDPA (fp32), relative error against fp64:")
    for causal in (False, True):
        for s, d in ((37, 16), (64, 32)):
            q, k, v = (torch.randn(1, 2, s, d, requires_grad=True) for _ in range(3))

            def out_and_grads(fn, *xs):
                out = fn(*xs)
                return (out, *torch.autograd.grad(out, xs, torch.ones_like(out)))

            exact = out_and_grads(lambda *x: standard_attention(*x, causal),
                                  *(t.detach().double().requires_grad_() for t in (q, k, v)))
            ours = out_and_grads(lambda *x: FlashAttentionTriton.apply(*x, causal)[0], q, k, v)
            sdpa = out_and_grads(lambda *x: F.scaled_dot_product_attention(*x, is_causal=causal), q, k, v)

            def rel(x, r):
                return ((x.detach().double() - r.detach()).norm() / r.detach().norm()).item()

            err, err_sdpa = (max(rel(a, r) for a, r in zip(xs, exact)) for xs in (ours, sdpa))
            floor = max(rel(r.float(), r) for r in exact)  # fp32 rounding of the exact values
            failures += err > 2 * err_sdpa + 2 * floor  # the tests' rule: twice PyTorch's error
            print(f"  causal={causal!s:<5} s={s:>3} d={d:>2}: ours {err:.1e}, SDPA {err_sdpa:.1e}")
    return int(failures > 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--cpu-lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tokens", type=int, default=16384, help="b s: tokens per batch on the GPU")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    seed_everything(0)
    device = pick_device(args.device)
    return bench_gpu(args, device) if device.type == "cuda" else bench_cpu(args, device)


if __name__ == "__main__":
    sys.exit(main())
