"""Step time and bytes sent per rank of labkit's tensor parallelism against PyTorch's, for t = 1, 2, 4.

    python scripts/bench_tensor_parallel.py                      # this machine: 4 gloo ranks on the CPU
    python scripts/bench_tensor_parallel.py --sequence-parallel --preset tiny --batch 4
    torchrun --standalone --nproc-per-node=4 scripts/bench_tensor_parallel.py --preset gpt2-medium \
        --vocab-size 50304 --batch 4

Every t runs over the "tp" axis of a (world_size / t, t) device mesh; t = 1 is the unsharded
model. For each t it prints, for rank 0, one training step's time (the best of --steps, after a
warm-up) and the bytes its collectives moved (counted by labkit's CommCounter, full-size tensors),
for labkit's `apply_tensor_parallel` and for PyTorch's DTensor `parallelize_module` on the same
ranks, and the ratio of the two: a ratio, not an absolute time, since the times depend on the
machine and on what else runs on it. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from labkit.dist import launch  # noqa: E402
from labkit.model import get_preset  # noqa: E402
from labkit.runs.tensor_parallel import bench_rank  # noqa: E402


def report(result: dict, tp_sizes, sequence_parallel: bool) -> None:
    """Print rank 0's step times and bytes, one row per t."""
    print(f"\n{'sequence parallel' if sequence_parallel else 'tensor parallel'} (rank 0; MB = 1e6 bytes)")
    print(f"{'t':>3}{'labkit ms':>11}{'DTensor ms':>12}{'time ratio':>12}{'labkit MB':>11}{'DTensor MB':>12}"
          f"{'calls':>8}{'DT calls':>10}")
    for t in tp_sizes:
        ours, theirs = result[(t, "labkit")], result[(t, "dtensor")]
        print(f"{t:>3}{ours['seconds'] * 1e3:>11.1f}{theirs['seconds'] * 1e3:>12.1f}"
              f"{ours['seconds'] / theirs['seconds']:>12.2f}{ours['bytes'] / 1e6:>11.2f}"
              f"{theirs['bytes'] / 1e6:>12.2f}{ours['calls']:>8}{theirs['calls']:>10}")
    print("time ratio = labkit / DTensor; a ratio above 1 means labkit is slower here.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="model preset (labkit.model.PRESETS)")
    parser.add_argument("--seq-len", type=int, default=None, help="override the preset's seq_len")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="override the preset's vocab_size (t must divide it: GPT-2's 50257 padded to 50304)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (every rank sees them all)")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--world-size", type=int, default=4, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration (best of)")
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("seq_len", args.seq_len), ("vocab_size", args.vocab_size)) if v}
    cfg = get_preset(args.preset, **overrides)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    bad = [t for t in args.tp_sizes if world_size % t]
    if bad:
        parser.error(f"--tp-sizes {bad} must divide the world size {world_size}")
    kwargs = dict(batch_size=args.batch, tp_sizes=tuple(args.tp_sizes), steps=args.steps,
                  sequence_parallel=args.sequence_parallel)
    if torchrun:  # this process is one rank
        [result] = launch(bench_rank, world_size, cfg, timeout_s=600, **kwargs)
        if int(os.environ["RANK"]) == 0:
            report(result, args.tp_sizes, args.sequence_parallel)
        return 0
    results = launch(bench_rank, world_size, cfg, backend="gloo", timeout_s=600, join_timeout_s=3600, **kwargs)
    report(results[0], args.tp_sizes, args.sequence_parallel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
