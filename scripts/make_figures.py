"""Draw the figures of Chapter 1 into chapters/figures/ (PNG, committed with the chapter).

    python scripts/make_figures.py

memory_wall.png   datacenter GPUs (datasheets) against the model states of published models
roofline.png      the roofline of the same GPUs, with two kinds of operators placed on it
activations.png   per-layer activation bytes of a 7B-class layer against sequence length
step_timeline.png one training step of the tiny GPT over time, steps 1 and 2 (measured on CPU)
timeline.png      each technique of the course: its first paper and date (intro)
collectives.png   all-reduce = reduce-scatter + all-gather on four ranks (Chapter 2)
zero_stages.png   model states per GPU against the number of ranks, per ZeRO stage (Chapter 2)
token_weights.png the weight each token gets under the naive and the window loss (Chapter 4)

    python scripts/make_figures.py [NAME ...]    # default: all of them

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
# Memory as the driver reports it (nvidia-smi, torch.cuda.get_device_properties), in MiB: the
# datasheets' "GB" is not the book's 10^9 bytes, so capacities are compared in these units only.
GPU_MIB = {"V100": 16_160, "A100": 40_536, "H100": 81_559, "H200": 143_771}
MiB = 2**20
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
    capacity = [GPU_MIB[g[0]] * MiB / 1e9 for g in GPUS]  # the driver's MiB, in 10^9 bytes
    right.step([g[1] for g in GPUS] + [2025], capacity + [capacity[-1]], where="post",
               color="#55A868", label="memory of one GPU (nvidia-smi's MiB, in GB)")
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


# technique, first paper (arXiv month or publication), the systems that made it common. Dates
# are the first public version of each paper (the arXiv number's year and month).
TIMELINE = [
    ("activation checkpointing", [(1992.0, "Griewank 1992, revolve 2000"),
                                  (2016.3, "Chen et al. 2016-04")], "torch.utils.checkpoint"),
    ("gradient accumulation", [(2018.45, "Ott et al. 2018-06")], "fairseq, DDP no_sync"),
    ("mixed precision", [(2017.8, "Micikevicius et al. 2017-10")], "apex, torch.amp"),
    ("pipeline parallelism", [(2018.45, "PipeDream 2018-06"), (2018.85, "GPipe 2018-11"),
                              (2020.45, "1F1B flush 2020-06"), (2021.25, "interleaved 2021-04")],
     "Megatron-LM, DeepSpeed"),
    ("tensor parallelism", [(2019.7, "Megatron-LM 2019-09")], "Megatron-LM"),
    ("ZeRO", [(2019.8, "ZeRO 2019-10"), (2021.05, "Offload 2021-01"),
              (2021.25, "Infinity 2021-04"), (2023.3, "FSDP 2023-04")], "DeepSpeed, PyTorch FSDP"),
    ("sequence parallelism", [(2022.35, "Korthikanti et al. 2022-05")], "Megatron-LM"),
    ("FlashAttention", [(2022.4, "FA1 2022-05"), (2023.55, "FA2 2023-07"), (2024.55, "FA3 2024-07")],
     "flash-attn, PyTorch SDPA"),
    ("PagedAttention", [(2023.7, "vLLM 2023-09")], "vLLM"),
    ("context parallelism", [(2023.7, "Ulysses 2023-09"), (2023.75, "Ring Attention 2023-10")],
     "Megatron-Core, torchtitan"),
]


def timeline(path: Path) -> None:
    # Drawn at 8 inches for a page column of about 750 px: 9-point labels show at about 11 px.
    fig, ax = plt.subplots(figsize=(8, 6.4))
    for row, (technique, papers, systems) in enumerate(TIMELINE):
        y = len(TIMELINE) - row
        xs = [max(x, 2015.2) for x, _ in papers]
        ax.plot([xs[0], 2025.3], [y, y], color="#DDDDDD", lw=6, solid_capstyle="butt", zorder=1)
        for i, ((x, label), shown) in enumerate(zip(papers, xs)):
            ax.plot(shown, y, "o", color="#4C72B0" if x >= 2015 else "#8C8C8C", zorder=3)
            text = label if x >= 2015 else f"← {label}"
            # alternate above and below; in a crowded row the first two labels end at their
            # dot and the others start at theirs, so neighbours do not overlap
            crowded = "right" if i < 2 else "left"
            ha = "left" if x < 2015 else crowded if len(papers) >= 4 else "center"
            ax.annotate(text, (shown, y), textcoords="offset points", fontsize=9,
                        xytext=(0, 7 if i % 2 == 0 else -15), ha=ha)
        ax.text(2025.4, y, systems, fontsize=9, va="center", color="#555555")
    ax.axvline(2019.8, color="#C44E52", ls=":", lw=1)
    ax.text(2019.85, 0.35, "ZeRO", color="#C44E52", fontsize=9)
    ax.set_yticks(range(1, len(TIMELINE) + 1), [t[0] for t in reversed(TIMELINE)], fontsize=9)
    ax.set_xlim(2015, 2029.6)
    ax.set_xticks(range(2015, 2026, 2))
    ax.tick_params(axis="x", labelsize=9)
    ax.set_ylim(0.2, len(TIMELINE) + 0.8)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title("first papers (dots: year-month of the first version)\n"
                 "right: the systems that made each technique common", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def collectives(path: Path) -> None:
    """Four ranks, a vector of four chunks each: reduce-scatter then all-gather (ring)."""
    n, colors = 4, ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
    titles = ["before: rank r holds its gradient g_r\n(4 chunks)",
              "after reduce-scatter: rank r holds\nchunk r of the sum (sent 3 chunks)",
              "after all-gather: every rank holds\nthe whole sum (sent 3 more chunks)"]
    for ax, title, stage in zip(axes, titles, range(3)):
        for r in range(n):
            for c in range(n):
                if stage == 0:
                    face, text = colors[r], f"g{r}[{c}]"
                elif stage == 1:
                    face, text = (("#333333", f"Σ[{c}]") if c == r else ("#EEEEEE", ""))
                else:
                    face, text = "#333333", f"Σ[{c}]"
                ax.add_patch(plt.Rectangle((c, n - 1 - r), 0.92, 0.86, color=face, alpha=0.85))
                ax.text(c + 0.46, n - 1 - r + 0.43, text, ha="center", va="center", fontsize=7,
                        color="white" if face != "#EEEEEE" else "black")
        ax.set_xlim(-0.1, n)
        ax.set_ylim(-0.1, n)
        ax.set_yticks([n - 1 - r + 0.43 for r in range(n)], [f"rank {r}" for r in range(n)],
                      fontsize=8)
        ax.set_xticks([c + 0.46 for c in range(n)], [f"chunk {c}" for c in range(n)], fontsize=7)
        ax.tick_params(length=0)
        ax.set_frame_on(False)
        ax.set_title(title, fontsize=8)
    fig.suptitle("all-reduce = reduce-scatter + all-gather: each rank sends (N-1)/N of the vector "
                 "in each half, 2(N-1)/N in all", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def zero_stages(path: Path) -> None:
    """Bytes per parameter per GPU against N_d (mixed-precision Adam, K = 12), and a 7.5B model."""
    ranks = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    per_param = {"data parallelism": lambda n: 16, "stage 1": lambda n: 4 + 12 / n,
                 "stage 2": lambda n: 2 + 14 / n, "stage 3": lambda n: 16 / n}
    colors = ["#8C8C8C", "#4C72B0", "#DD8452", "#55A868"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (name, f), color in zip(per_param.items(), colors):
        left.plot(ranks, [f(n) for n in ranks], "o-", color=color, label=name, ms=4)
        right.plot(ranks, [7.5e9 * f(n) / 1e9 for n in ranks], "o-", color=color, label=name, ms=4)
    for gpu in ("A100", "H100", "H200"):
        gb = GPU_MIB[gpu] * MiB / 1e9
        right.axhline(gb, color="k", ls=":", lw=0.8)
        right.text(1.05, gb * 1.06, f"{gpu}: {GPU_MIB[gpu]:,} MiB = {gb:.1f} GB", fontsize=7)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("data-parallel ranks $N_d$")
        ax.legend(fontsize=8, frameon=False, loc="lower left")
    left.set_ylabel("bytes per parameter per GPU")
    left.set_title("model states per GPU, mixed-precision Adam", fontsize=9)
    right.set_ylabel("GB per GPU")
    right.set_title("a 7.5B-parameter model: which stage fits", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def token_weights(path: Path) -> None:
    """Chapter 4: a token's weight relative to the correct 1/N under the naive mean."""
    tokens = [180, 30, 120, 70]  # real tokens in each of k = 4 micro-batches
    k, total = len(tokens), sum(tokens)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = [total / (k * n) for n in tokens]
    ax.bar(range(k), bars, color="#C44E52", label="naive: mean per micro-batch, then / k")
    ax.axhline(1, color="#4C72B0", lw=2, label="window: sum / N (every token weighs 1/N)")
    for i, (n, w) in enumerate(zip(tokens, bars)):
        ax.text(i, w + 0.05, f"{w:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(range(k), [f"micro-batch {i + 1}\n$N_{i + 1}$ = {n} tokens"
                             for i, n in enumerate(tokens)], fontsize=8)
    ax.set_ylabel("weight of one token / (1/N)")
    ax.set_ylim(0, max(bars) * 1.25)
    ax.legend(fontsize=8, frameon=False, loc="upper right")
    ax.set_title(f"k = {k} micro-batches, N = {total} tokens: naive weight N / (k N_i)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


FIGURES = {"memory_wall": memory_wall, "roofline": roofline, "activations": activations,
           "step_timeline": step_timeline, "timeline": timeline, "collectives": collectives,
           "zero_stages": zero_stages, "token_weights": token_weights}


def main(argv=None) -> None:
    import sys

    names = (sys.argv[1:] if argv is None else argv) or list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise SystemExit(f"error: figure(s) {unknown} unknown; valid names: {list(FIGURES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names:
        FIGURES[name](OUT / f"{name}.png")
        print("wrote", (OUT / f"{name}.png").relative_to(ROOT))


if __name__ == "__main__":
    main()
