"""Pipeline schedules on CPU ranks (or GPUs): measured bubble against the formula, and step time of
labkit's runtime against torch.distributed.pipelining.

    python scripts/bench_pipeline.py                 # 4 gloo ranks on this machine
    python scripts/bench_pipeline.py --pp-size 2 --steps 5
    python scripts/bench_pipeline.py --forward-ms 150  # stages 5x longer beside the messages
    python scripts/bench_pipeline.py --forward-ms 150 --busy 30  # part 1 beside 30 busy processes
    python scripts/bench_pipeline.py --backend nccl    # one rank per GPU (needs --pp-size GPUs)
    python scripts/bench_pipeline.py --record scripts/results/bench_pipeline.md  # append a dated record

Part 1 runs a synthetic workload whose stages sleep a set time (forward --forward-ms, 30 ms by
default, backward twice that), so the bubble is the schedule's and not the machine's, for GPipe,
1F1B and interleaved 1F1B (v = 2) over m, and prints the recorded bubble (least disturbed of three
runs) beside (p - 1)/(m + p - 1) or (p - 1)/(v m + p - 1), and beside the bubble of its replay:
the schedule simulated with the durations that run measured for each action and the cost of a
message measured around it (``labkit.pipeline.replay``), what a runtime that waits for nothing but
its inputs idles on the stages a loaded machine made unequal. --busy N runs part 1 beside N
processes that spin on the CPU, a busy machine made on purpose. Part 2 trains the tiny GPT (2p layers)
one step per schedule with labkit's runtime and with ScheduleGPipe, Schedule1F1B and
ScheduleInterleaved1F1B on the same split, and prints the ratio of step times (the fastest of
--steps, slowest rank).
With --backend nccl the same runtime runs with each rank on its own GPU (the model, the batches
and the messages on CUDA; the recorded times wait for the GPU to finish).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import subprocess
import sys

import torch

from labkit.dist import launch
from labkit.model import get_preset
from labkit.pipeline import Timeline, bubble_fraction, make_schedule, replay
from labkit.runs.pipeline import bench_rank, pipeline_rank


def _record(path: str, argv: list, text: str) -> None:
    """Append a dated section (command, machine, load, versions, what was printed) to ``path``."""
    import labkit

    load = os.getloadavg() if hasattr(os, "getloadavg") else ("n/a",) * 3
    head = (f"\n## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
            f"`python scripts/bench_pipeline.py {' '.join(argv)}` on {platform.machine()}, "
            f"{os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
            f"(1 / 5 / 15 min) at the end; Python {platform.python_version()}, torch {torch.__version__}, "
            f"labkit {labkit.__version__}\n\n")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(head + "```text\n" + text + "```\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--forward-ms", type=float, default=30.0, help="a stage's forward; backward is twice it")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                    help="gloo: CPU processes; nccl: one GPU a rank")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="run part 1 beside N processes that spin on the CPU (default 0)")
    ap.add_argument("--record", metavar="PATH", help="also append what is printed, dated, to PATH")
    args = ap.parse_args()
    if args.record:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            _bench(ap, args)
        sys.stdout.write(buf.getvalue())
        _record(args.record, sys.argv[1:], buf.getvalue())
    else:
        _bench(ap, args)


def _bench(ap, args) -> None:
    """Part 1 (the synthetic stages' bubbles) and part 2 (the tiny GPT's step times)."""
    if args.forward_ms <= 0:
        ap.error(f"--forward-ms={args.forward_ms} must be > 0")
    if args.busy < 0:
        ap.error(f"--busy={args.busy} must be >= 0")
    f = args.forward_ms / 1e3
    p = args.pp_size
    if args.backend == "nccl" and torch.cuda.device_count() < p:
        ap.error(f"--backend nccl needs --pp-size={p} GPUs; this machine has {torch.cuda.device_count()}")
    where = "CPU" if args.backend == "gloo" else "GPU"
    ms = [p, 2 * p, 4 * p]
    cases = [(s, m, 1) for s in ("gpipe", "1f1b") for m in ms] + [("interleaved", m, 2) for m in ms]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        runs = launch(pipeline_rank, p, sleep_cases=cases, sleep_repeats=3, sleep_costs=(f, 2 * f),
                      backend=args.backend, timeout_s=300)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    beside = f", beside {args.busy} busy processes" if args.busy else ""
    print(f"bubble on {p} {where} ranks, synthetic stages (forward {f * 1e3:g} ms, backward {2 * f * 1e3:g} ms)"
          + beside)
    print(f"{'schedule':12s} {'v':>2s} {'m':>3s} {'measured':>9s} {'formula':>8s} {'error':>7s} "
          f"{'replay':>7s} {'error':>7s} {'message':>8s}")
    for case in cases:
        tl, msg = min(((Timeline([r["sleep"][case][i]["events"] for r in runs]),
                        runs[0]["sleep"][case][i]["message_s"]) for i in range(3)),
                      key=lambda t: t[0].makespan)
        want = bubble_fraction(p, case[1], case[0], case[2])
        again = replay(tl, make_schedule(case[0], p, case[1], case[2]), msg).bubble
        print(f"{case[0]:12s} {case[2]:2d} {case[1]:3d} {tl.bubble:9.3f} {want:8.3f} "
              f"{(tl.bubble - want) / want:+7.1%} {again:7.3f} {(tl.bubble - again) / again:+7.1%} "
              f"{msg * 1e3:5.2f} ms")
    cfg = get_preset("tiny", n_layer=2 * p)  # two layers a rank: room for v = 2 chunks
    gpt_cases = [("gpipe", 2 * p, 1), ("1f1b", 2 * p, 1), ("interleaved", 2 * p, 2)]
    times = launch(bench_rank, p, gpt_cases, steps=args.steps, cfg=cfg, global_batch=4 * p,
                   backend=args.backend, timeout_s=300)
    print(f"\nstep time of the tiny GPT with {2 * p} layers on {p} {where} ranks "
          f"(fastest of {args.steps}, slowest rank)")
    print(f"{'schedule':12s} {'v':>2s} {'m':>3s} {'labkit (s)':>11s} {'torch (s)':>10s} {'ratio':>6s}")
    for case in gpt_cases:
        ours = max(t[case][0] for t in times)
        theirs = max(t[case][1] for t in times)
        print(f"{case[0]:12s} {case[2]:2d} {case[1]:3d} {ours:11.4f} {theirs:10.4f} {ours / theirs:6.2f}")


if __name__ == "__main__":
    main()
