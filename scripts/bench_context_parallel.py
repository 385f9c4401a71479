"""Ring attention against full attention per rank, for cp = 1, 2, 4; and PyTorch's own context parallelism.

    python scripts/bench_context_parallel.py                   # gloo ranks on this machine's CPU
    python scripts/bench_context_parallel.py --seq-len 2048 --heads 8 --head-dim 64

For each cp it spawns cp ranks; each times a causal forward + backward of ring attention on its
zigzag shard (float32) and of full attention (the whole sequence, what each rank runs without
context parallelism), both with labkit.attention's reference attention (the ring's kernel for a block), and measures both steps' peak bytes with labkit's memory meter
(activations and temporaries; the inputs are not counted). It prints rank 0's ratios, ring over
full: ratios, not absolute times, since those depend on the machine and its load. Then it tries
``torch.distributed.tensor.experimental.context_parallel`` on 2 gloo ranks and says whether it ran
and, if so, how far its output is from full attention. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from labkit.dist import launch  # noqa: E402
from labkit.runs.context_parallel import bench_rank, torch_cp_rank  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024, help="divisible by 2 cp for every cp")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (mean)")
    args = parser.parse_args(argv)
    print(f"causal attention, B={args.batch}, heads={args.heads}, s={args.seq_len}, d={args.head_dim}, float32, "
          "gloo ranks on the CPU (rank 0; MB = 1e6 bytes)")
    print(f"{'cp':>3}{'ring ms':>10}{'full ms':>10}{'time ratio':>12}{'ring MB':>10}{'full MB':>10}{'memory ratio':>14}")
    for cp in args.cp_sizes:
        r = launch(bench_rank, cp, args.batch, args.heads, args.seq_len, args.head_dim, args.repeats,
                   backend="gloo", timeout_s=600, join_timeout_s=1800)[0]
        ring, full = r["ring"], r["full"]
        print(f"{cp:>3}{ring['seconds'] * 1e3:>10.1f}{full['seconds'] * 1e3:>10.1f}"
              f"{ring['seconds'] / full['seconds']:>12.2f}{ring['peak_bytes'] / 1e6:>10.2f}"
              f"{full['peak_bytes'] / 1e6:>10.2f}{ring['peak_bytes'] / full['peak_bytes']:>14.3f}")
    print("ratio = ring / full per rank; the ranks share this machine's cores, so time ratios above 1/cp\n"
          "measure the CPU's contention as much as the ring.")
    try:
        tc = launch(torch_cp_rank, 2, backend="gloo", timeout_s=120)
    except Exception as e:  # noqa: BLE001  (said plainly below)
        tc = [{"ran": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"}]
    if all(r["ran"] for r in tc):
        print(f"PyTorch context_parallel on 2 gloo ranks ran; largest relative error against full attention: "
              f"{max(r['error'] for r in tc)}")
    else:
        print(f"PyTorch context_parallel does not run here (2 gloo ranks, CPU): {tc[0]['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
