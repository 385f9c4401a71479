"""KV memory waste and serving throughput of the paged engine against contiguous reservation.

    python scripts/bench_paged_attention.py                  # CUDA when present, else CPU
    python scripts/bench_paged_attention.py --device cpu --requests 32 --preset tiny

Part 1 (no forwards, every device alike): a ShareGPT-like trace (labkit.paged_attention.SHAREGPT,
the mean lengths of Kwon et al. 2023, Fig. 11, log-normal) served with --slots KV token slots and
OPT's 2048 positions; prints the share of KV memory holding token states, reservation, internal
and external fragmentation for contiguous maximum-length, contiguous exact-length (oracle) and
paged caches, then the paged cache over block sizes 8, 16, 32, 64.
Part 2 (real forwards): the GPT preset (--preset, seq_len --seq-len) serves --requests requests,
lengths scaled to its positions, with a budget of --budget-blocks blocks of 16 tokens, paged and
contiguous; prints the time of one decode step against the batch size, then the largest batch,
the tokens run through the model (recomputation included), generated tokens per second and
their ratio. The lab's ``SCALE = 8`` is ``--requests 384 --budget-blocks 512``. The exit status
is 1 if the two engines' tokens differ.
"""

from __future__ import annotations

import argparse
import sys

import torch

from labkit.device import pick_device, seed_everything
from labkit.model import build_model, get_preset
from labkit.paged_attention import SHAREGPT, Engine, decode_step_seconds, synthetic_trace


def waste_table(slots: int, requests: int) -> None:
    trace = synthetic_trace(requests, SHAREGPT, max_len=2048, rate=0.5, seed=0)
    print(f"Part 1: {requests} ShareGPT-like requests, {slots:,} KV slots, max_len 2048")
    runs = [(kind, 16) for kind in ("max", "oracle", "paged")] + [("paged", bs) for bs in (8, 32, 64)]
    for kind, bs in runs:
        engine = Engine(None, num_blocks=slots // bs, block_size=bs, reservation=kind, max_len=2048)
        parts = engine.serve(trace).waste.fractions()
        print(f"  {kind:<6} block {bs:>2}: " + ", ".join(f"{k} {100 * v:5.1f}%" for k, v in parts.items()))


def throughput(device, preset: str, seq_len: int, requests: int, budget_blocks: int) -> bool:
    seed_everything(0)
    cfg = get_preset(preset, seq_len=seq_len)
    model = build_model(cfg, device=device).eval()
    trace = synthetic_trace(requests, SHAREGPT, max_len=seq_len, scale=seq_len / 2048,
                            vocab_size=cfg.vocab_size, seed=1)
    print(f"Part 2: {preset} (seq_len {seq_len}) on {device.type}, {requests} requests, "
          f"{budget_blocks * 16:,} KV slots")
    Engine(model, num_blocks=budget_blocks).serve(trace[:4])  # warm-up
    one = decode_step_seconds(model, 1, seq_len // 4)
    for b in (4, 16, 64, 256):
        ratio = decode_step_seconds(model, b, seq_len // 4) / one
        print(f"  a decode step of batch {b:>3} takes {ratio:5.1f}x one of batch 1")
    results = {kind: Engine(model, num_blocks=budget_blocks, reservation=kind).serve(trace, progress=True, desc=kind)
               for kind in ("paged", "max")}
    for kind, res in results.items():
        print(f"  {kind:<6} largest batch {max(res.batch_sizes):>4}, preemptions {res.preemptions:>3}, "
              f"{res.tokens_forwarded:>8,} tokens forwarded, {res.tokens_per_second:9.0f} generated tokens/s")
    print(f"  paged / contiguous throughput: {results['paged'].tokens_per_second / results['max'].tokens_per_second:.2f}x")
    return results["paged"].outputs == results["max"].outputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--slots", type=int, default=16384, help="KV token slots of part 1")
    parser.add_argument("--waste-requests", type=int, default=200)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--budget-blocks", type=int, default=64, help="blocks of 16 tokens in part 2")
    args = parser.parse_args(argv)
    if args.slots % 64:
        parser.error(f"--slots={args.slots} must be a multiple of 64 (the largest block size)")
    if args.device == "cpu":
        torch.set_num_threads(1)
    waste_table(args.slots, args.waste_requests)
    same = throughput(pick_device(args.device), args.preset, args.seq_len, args.requests, args.budget_blocks)
    print(f"paged and contiguous engines produced the same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
