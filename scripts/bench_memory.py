"""Predicted against measured memory of one training step of the tiny GPT, over a grid of configurations.

    python scripts/bench_memory.py                 # CUDA when present, else CPU
    python scripts/bench_memory.py --device cpu

For each configuration (precision, optimizer, batch b, sequence length s, depth L, dropout) it
measures a steady-state step (the second) with labkit.memory.measure_step and compares it with
the formulas of Chapter 1: model states must agree to the byte, activations within 5 % (on CPU
they agree exactly). Prints a table; the exit status is 1 if any configuration disagrees.
"""

from __future__ import annotations

import argparse
import sys

import torch

from labkit.data import batches
from labkit.device import pick_device, seed_everything
from labkit.memory import activation_bytes, measure_step, model_state_bytes
from labkit.model import count_params, build_model, get_preset
from labkit.precision import make_optimizer, model_dtype

ACTIVATION_TOLERANCE = 0.05

# (precision, optimizer, b, s, L, dropout): each row changes one or two things from its neighbours.
CONFIGS = [
    ("fp32", "adamw", 8, 64, 4, 0.0),
    ("mixed", "adamw", 8, 64, 4, 0.0),
    ("bf16", "adamw", 8, 64, 4, 0.0),
    ("mixed", "sgd_momentum", 4, 64, 4, 0.1),
    ("fp32", "sgd", 16, 32, 2, 0.1),
    ("bf16", "adam", 2, 64, 6, 0.1),
    ("mixed", "adam", 4, 16, 8, 0.0),
]


def measure(precision, optimizer, b, s, n_layer, dropout, device):
    """Measured and predicted bytes of one steady-state step, as two dicts with the same keys."""
    cfg = get_preset("tiny", n_layer=n_layer, seq_len=s, dropout=dropout)
    seed_everything(0)
    model = build_model(cfg, device=device, dtype=model_dtype(precision))
    # The per-parameter loop on every device, so that CPU and CUDA allocate the same temporaries.
    opt = make_optimizer(model.parameters(), precision, optimizer, foreach=False)
    batch = next(batches(b, s, device=device))
    measure_step(model, opt, batch)  # step 1 creates the optimizer states
    report = measure_step(model, opt, batch)
    states = model_state_bytes(count_params(cfg), precision, optimizer, n_tensors=len(list(model.parameters())),
                               device_type=device.type)  # on CUDA, Adam's step counters are host memory
    acts = activation_bytes(cfg, b, dtype_bytes=model_dtype(precision).itemsize, device_type=device.type)
    measured = {"params": report.max_by_category["parameters"], "grads": report.max_by_category["gradients"],
                "optimizer": report.max_by_category["optimizer"], "activations": report.activations}
    predicted = {"params": states.params, "grads": states.grads, "optimizer": states.optimizer,
                 "activations": acts.total}
    return measured, predicted, report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: CUDA when present")
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    print(f"device: {device.type}, torch {torch.__version__}\n")
    header = (f"{'precision':<9} {'optimizer':<12} {'b':>3} {'s':>4} {'L':>2} {'drop':>4} | "
              f"{'states predicted':>16} {'measured':>12} | {'activations pred.':>17} {'measured':>12} "
              f"{'ratio':>7} | {'peak MiB':>8} {'peak in':<9} | ok")
    print(header)
    print("-" * len(header))
    failures = 0
    for precision, optimizer, b, s, n_layer, dropout in CONFIGS:
        measured, predicted, report = measure(precision, optimizer, b, s, n_layer, dropout, device)
        states_p = sum(predicted[k] for k in ("params", "grads", "optimizer"))
        states_m = sum(measured[k] for k in ("params", "grads", "optimizer"))
        states_ok = all(measured[k] == predicted[k] for k in ("params", "grads", "optimizer"))
        ratio = measured["activations"] / predicted["activations"]
        acts_ok = abs(ratio - 1) <= ACTIVATION_TOLERANCE
        ok = states_ok and acts_ok
        failures += not ok
        print(f"{precision:<9} {optimizer:<12} {b:>3} {s:>4} {n_layer:>2} {dropout:>4} | "
              f"{states_p:>16,} {states_m:>12,} | {predicted['activations']:>17,} {measured['activations']:>12,} "
              f"{ratio:>7.4f} | {report.peak_bytes / 2**20:>8.2f} {report.peak_phase:<9} | "
              f"{'yes' if ok else 'NO'}")
        if not states_ok:
            for k in ("params", "grads", "optimizer"):
                if measured[k] != predicted[k]:
                    print(f"    {k}: measured {measured[k]:,} != predicted {predicted[k]:,}")
    print()
    if failures:
        print(f"{failures} of {len(CONFIGS)} configurations disagree with the formulas.")
        return 1
    print(f"All {len(CONFIGS)} configurations: model states exact to the byte, "
          f"activations within {ACTIVATION_TOLERANCE:.0%} of the prediction for {device.type}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
