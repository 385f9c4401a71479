"""Draw the figures of Chapter 1 into chapters/figures/ (PNG, committed with the chapter).

    python scripts/make_figures.py

memory_wall.png   datacenter GPUs (datasheets) against the model states of published models
roofline.png      the roofline of the same GPUs, with two kinds of operators placed on it
activations.png   per-layer activation bytes of a 7B-class layer against sequence length
step_timeline.png one training step of the tiny GPT over time, steps 1 and 2 (measured on CPU)

Hardware numbers are the SXM parts' datasheet values (see GPUS); parameter counts are the papers'.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "chapters" / "figures"

# name, year, dense 16-bit tensor-core TFLOP/s, HBM GB, HBM GB/s: the SXM part at launch.
# V100: 125 TFLOP/s fp16 tensor, 16 GB, 900 GB/s (nvidia2017v100). A100: 312 bf16, 40 GB,
# 1,555 GB/s (nvidia2021a100). H100 and H200: 1,979 bf16 "with sparsity" in the datasheets,
# 989 dense; 80 GB at 3,350 GB/s (nvidia2022h100) and 141 GB at 4,800 GB/s (nvidia2023h200).
GPUS = [
    ("V100", 2017, 125, 16, 900),
    ("A100", 2020, 312, 40, 1555),
    ("H100", 2022, 989, 80, 3350),
    ("H200", 2024, 989, 141, 4800),
]
# name, year, parameters (the papers): GPT-2 (radford2019language), Megatron-LM (shoeybi2019megatron),
# GPT-3 (brown2020language), LLaMA-65B (touvron2023llama).
MODELS = [
    ("GPT-2", 2019, 1.5e9),
    ("Megatron-LM", 2019, 8.3e9),
    ("GPT-3", 2020, 175e9),
    ("LLaMA-65B", 2023, 65e9),
]
BYTES_PER_PARAM = 16  # mixed-precision Adam (rajbhandari2020zero)


def memory_wall(path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    years = [g[1] for g in GPUS]
    base = GPUS[0]
    for idx, label, color in ((2, "peak 16-bit FLOP/s", "#C44E52"), (4, "memory bandwidth", "#4C72B0"),
                              (3, "memory capacity", "#55A868")):
        rel = [g[idx] / base[idx] for g in GPUS]
        left.plot(years, rel, "o-", color=color, label=label)
        left.annotate(f"{rel[-1]:.1f}x", (years[-1], rel[-1]), textcoords="offset points", xytext=(6, -3),
                      fontsize=8, color=color)
    for name, year, *_ in GPUS:
        left.annotate(name, (year, 1), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    left.set_yscale("log")
    left.set_ylim(0.5, 20)
    left.set_xlim(2016.3, 2025.2)
    left.set_ylabel("relative to V100 (2017)")
    left.set_title("one datacenter GPU, from its datasheet", fontsize=10)
    left.legend(fontsize=8, frameon=False, loc="upper left")

    for name, year, params in MODELS:
        gb = BYTES_PER_PARAM * params / 1e9
        right.scatter(year, gb, color="#8172B3", zorder=3)
        right.annotate(f"{name}\n{gb:,.0f} GB", (year, gb), textcoords="offset points", xytext=(6, -4),
                       fontsize=8)
    right.step([g[1] for g in GPUS] + [2025], [g[3] for g in GPUS] + [GPUS[-1][3]], where="post",
               color="#55A868", label="memory of one GPU")
    right.set_yscale("log")
    right.set_xlim(2016.3, 2025.2)
    right.set_ylim(8, 1e4)
    right.set_ylabel("GB")
    right.set_title("model states at 16 bytes per parameter", fontsize=10)
    right.legend(fontsize=8, frameon=False, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def roofline(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    intensity = [2.0 ** (k / 16) for k in range(-4 * 16, 12 * 16 + 1)]  # 1/16 ... 4096 FLOP/B
    colors = ["#8C8C8C", "#4C72B0", "#C44E52", "#55A868"]
    for (name, _, tflops, _, gbs), color in zip(GPUS, colors):
        attainable = [min(tflops, i * gbs / 1e3) for i in intensity]  # TFLOP/s
        ax.plot(intensity, attainable, color=color, label=f"{name}: ridge at {tflops * 1e3 / gbs:.0f} FLOP/B")
        ax.plot([tflops * 1e3 / gbs], [tflops], "o", color=color, ms=4)
    # Two operators in bf16 (2 bytes per element): c = a + b reads 2 and writes 1 element per FLOP;
    # an n x n by n x n matmul does 2n^3 FLOPs on 3n^2 elements, n / 3 FLOP per byte.
    for x, text, side in ((1 / 6, "elementwise add\n1/6 FLOP/B", "left"),
                          (4096 / 3, "matmul, n = 4096\nn/3 = 1365 FLOP/B", "right")):
        ax.axvline(x, color="k", ls=":", lw=1)
        ax.text(x * (1.15 if side == "left" else 1 / 1.15), 0.15, text, fontsize=8, va="bottom", ha=side)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_ylim(0.1, 2000)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.set_title("the roofline: min(peak FLOP/s, intensity x bandwidth)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def activations(path: Path) -> None:
    from labkit.memory import activation_bytes
    from labkit.model import get_preset

    # Korthikanti et al.'s setting: 16-bit activations, 1-byte dropout masks (CUDA), dropout on.
    cfg = get_preset("llama-7b-like", dropout=0.1)
    seqs = [256 * 2**k for k in range(7)]  # 256 ... 16384
    linear, quadratic = [], []
    for s in seqs:
        terms = activation_bytes(cfg, 1, s, dtype_bytes=2, device_type="cuda").terms
        sq = sum(v for k, v in terms.items() if "s^2" in k)
        quadratic.append(sq / 2**30)
        linear.append((sum(terms.values()) - sq) / 2**30)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(seqs, linear, "o-", color="#4C72B0", label="terms in sbh (weights' inputs, MLP, masks, LN)")
    ax.plot(seqs, quadratic, "o-", color="#C44E52", label="terms in as²b (attention scores, their dropout)")
    crossover = 34 * cfg.d_model / (5 * cfg.n_head)
    ax.axvline(crossover, color="k", ls=":", lw=1)
    ax.text(crossover * 1.08, min(quadratic), f"s = 34h / 5a = {crossover:.0f}", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("GiB per layer, b = 1")
    ax.set_title(f"one layer with h = {cfg.d_model}, a = {cfg.n_head}, 16-bit activations", fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def step_timeline(path: Path) -> None:
    import torch

    from labkit.data import batches
    from labkit.memory import measure_step, plot_timeline
    from labkit.model import build_model, get_preset
    from labkit.precision import make_optimizer, model_dtype

    cfg = get_preset("tiny")
    torch.manual_seed(0)
    model = build_model(cfg, dtype=model_dtype("mixed"))
    opt = make_optimizer(model.parameters(), "mixed", "adamw", foreach=False)
    batch = next(batches(8, cfg.seq_len))
    step1 = measure_step(model, opt, batch)
    step2 = measure_step(model, opt, batch)
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharey=True)
    plot_timeline(step1, ax=axes[0], title="step 1: Adam's moments are created inside optimizer.step()")
    plot_timeline(step2, ax=axes[1], title="step 2, and every step after it")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, draw in (("memory_wall", memory_wall), ("roofline", roofline), ("activations", activations),
                       ("step_timeline", step_timeline)):
        draw(OUT / f"{name}.png")
        print("wrote", (OUT / f"{name}.png").relative_to(ROOT))


if __name__ == "__main__":
    main()
