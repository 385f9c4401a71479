"""Memory per rank, communication and step time of data parallelism and ZeRO's three stages.

    python scripts/bench_zero.py                    # this machine: gloo ranks on the CPU, N = 1, 2, 4
    python scripts/bench_zero.py --world-sizes 2 8 --kinds ddp_torch zero3 fsdp2
    torchrun --standalone --nproc-per-node=8 scripts/bench_zero.py --preset gpt2-medium   # GPUs, NCCL

For each world size N and scheme it prints, for rank 0: the model states measured by the memory
meter (parameters, gradients, optimizer states) beside the formula of Chapter 2, the peak of the
step, the elements each collective moved in units of Psi, the megabytes the rank communicated
(an all-reduce counted twice, as in the paper) and the step time relative to torch's DDP. A
benchmark, not a test: the times depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from labkit.dist import launch  # noqa: E402
from labkit.runs.zero import KINDS, STAGE, train_rank  # noqa: E402
from labkit.zero import comm_volume, zero_model_state_bytes  # noqa: E402

CATS = ("parameters", "gradients", "optimizer")
FORMULA = {"parameters": "params", "gradients": "grads", "optimizer": "optimizer"}


def report(world_size: int, result: dict) -> None:
    """Print rank 0's measurements of one world size, one row per scheme."""
    mb = 1e6
    print(f"\nN = {world_size}   (MB per rank; formula = fp32 AdamW, Chapter 2; comm in elements / psi)")
    print(f"{'scheme':<13}" + "".join(f"{c:>12}" for c in CATS) + f"{'formula':>10}{'peak':>9}"
          f"{'all_red':>9}{'red_sc':>8}{'all_ga':>8}{'bcast':>7}{'volume':>8}{'comm MB':>9}{'time/DDP':>10}")
    base = result.get("ddp_torch", {}).get("seconds")
    for kind, res in result.items():
        mem, psi = res["memory"], res["n_params"]
        want = zero_model_state_bytes(psi, world_size, STAGE[kind], precision="fp32", optimizer="adamw")
        numel = {k: v["numel"] for k, v in res["comm"].items()}
        sent = comm_volume({k: v["bytes"] for k, v in res["comm"].items()}) / mb  # measured bytes
        comm = "".join(f"{numel.get(k, 0) / psi:>{w}.2f}" for k, w in
                       (("all_reduce", 9), ("reduce_scatter", 8), ("all_gather", 8), ("broadcast", 7)))
        ratio = f"{res['seconds'] / base:>10.2f}" if base else f"{'':>10}"
        volume = comm_volume(numel) / psi
        print(f"{kind:<13}" + "".join(f"{mem[c] / mb:>12.2f}" for c in CATS)
              + f"{want.total / mb:>10.2f}{mem['peak'] / mb:>9.2f}{comm}{volume:>8.2f}{sent:>9.2f}{ratio}")
    if "offload" in result:
        print("offload: its optimizer column also holds the host's fp32 copy of the rank's parameter slice,")
        print("which the CPU step updates (4 psi / N bytes); the stage-2 formula beside it does not count it.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="model preset (labkit.model.PRESETS)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4],
                        help="numbers of processes to spawn (ignored under torchrun)")
    parser.add_argument("--kinds", nargs="+", default=["ddp_torch", "zero1", "zero2", "zero3", "offload"],
                        choices=list(KINDS), help="schemes to run")
    parser.add_argument("--steps", type=int, default=5, help="steps per scheme; step 2 is measured")
    parser.add_argument("--batch-per-rank", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps={args.steps} must be >= 3: step 2 is the measured one")
    common = dict(steps=args.steps, measure_step=2, preset=args.preset, seq_len=args.seq_len)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        world_size = int(os.environ["WORLD_SIZE"])
        [result] = launch(train_rank, world_size, args.kinds, global_batch=args.batch_per_rank * world_size,
                          threads=max(os.cpu_count() // world_size, 1), timeout_s=600, **common)
        if int(os.environ["RANK"]) == 0:
            report(world_size, {k: v for k, v in result.items() if k in args.kinds})
        return 0
    for world_size in args.world_sizes:
        results = launch(train_rank, world_size, args.kinds, global_batch=args.batch_per_rank * world_size,
                         backend="gloo", timeout_s=600, join_timeout_s=3600, **common)
        report(world_size, {k: v for k, v in results[0].items() if k in args.kinds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
