"""Expert parallelism against every expert on every rank, for ep = 1, 2, 4; and skewed routing's cost.

    python scripts/bench_expert_parallel.py                    # 4 gloo ranks on this machine's CPU
    python scripts/bench_expert_parallel.py --d-model 256 --experts 16 --seqs-per-rank 8

One launch of --world ranks (data parallelism over all of them). For each ep (ep = 1: every
expert replicated on every rank, plain data parallelism) it builds the same small MoE GPT
(float32, dropless top-k routing), and times one SGD step (forward, backward, gradient reduction,
step) with the router's own routing ("balanced") and with every token steered to the first ep
rank's experts ("skewed": one rank computes every routed row while the others wait). CommCounter
counts, for one step on rank 0, the all-to-all bytes (dispatch, combine, their backward and the
counts; a call's send and receive buffers both) and the all-reduce bytes (the gradients: an
expert's only over its replicas). Times are ratios to ep = 1's balanced step as well as
milliseconds, since the ranks share this machine's cores. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from labkit.dist import launch  # noqa: E402
from labkit.model import GPTConfig  # noqa: E402
from labkit.runs.expert_parallel import ep_bench_rank  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks (data parallelism over all)")
    parser.add_argument("--ep-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--experts", type=int, default=8, help="routed experts E per MoE layer")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--d-expert", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seqs-per-rank", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (mean)")
    args = parser.parse_args(argv)
    for ep in args.ep_sizes:
        if args.world % ep or args.experts % ep or args.top_k > args.experts // ep:
            parser.error(f"--ep-sizes {ep}: ep must divide --world={args.world} and --experts={args.experts}, "
                         f"and --top-k={args.top_k} must not exceed E / ep (the skewed routing picks one rank's)")
    cfg = GPTConfig(n_layer=args.layers, n_head=4, d_model=args.d_model, vocab_size=256, seq_len=args.seq_len,
                    norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False,
                    n_experts=args.experts, experts_per_token=args.top_k, d_expert=args.d_expert, router_bias=True)
    out = launch(ep_bench_rank, args.world, cfg, tuple(args.ep_sizes), args.seqs_per_rank, args.repeats,
                 backend="gloo", timeout_s=600, join_timeout_s=1800)[0]
    print(f"MoE GPT: {args.layers} layers, h={args.d_model}, E={args.experts}, k={args.top_k}, f={args.d_expert}, "
          f"{args.seqs_per_rank} x {args.seq_len} tokens a rank, float32, {args.world} gloo ranks on the CPU "
          "(rank 0; MB = 1e6 bytes)")
    print(f"{'ep':>3}{'routing':>10}{'step ms':>10}{'vs ep=1':>9}{'sent':>7}{'computed':>10}{'all-to-all MB':>15}"
          f"{'all-reduce MB':>15}{'expert params':>15}")
    base = out[(args.ep_sizes[0], "balanced")]["seconds"]
    for (ep, routing), r in out.items():
        print(f"{ep:>3}{routing:>10}{r['seconds'] * 1e3:>10.1f}{r['seconds'] / base:>9.2f}{sum(r['rows']):>7}{r['computed']:>10}"
              f"{r['all_to_all'] / 1e6:>15.3f}{r['all_reduce'] / 1e6:>15.3f}{r['expert_params']:>15,}")
    print("sent: the (token, expert) rows rank 0's MoE layers dispatched; computed: the rows its experts ran\n"
          "(both summed over layers). Skewed: every token goes to the first ep rank's experts, so rank 0\n"
          "computes every row of its ep group, ep times its balanced share, while the others wait; at ep = 1\n"
          "each rank computes its own rows, so skew costs nothing there. The ranks share this machine's\n"
          "cores: times measure the CPU's contention as much as the exchange; on GPUs the skewed step\n"
          "waits for the busiest rank.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
