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

Each figure is drawn twice from the same numbers: NAME.png in English and NAME.zh_CN.png in
Chinese, with a CJK font (labkit.book.chinese_figures; fonts-noto-cjk). The Chinese edition shows
the second (Sphinx's figure_language_filename, "{root}.{language}{ext}"). Each drawing function
takes ``t``, and writes every text as ``t("english", "中文")``.

Hardware numbers are the SXM parts' datasheet values (see GPUS); parameter counts are the papers'.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "chapters" / "figures"
LANGUAGE = "zh_CN"  # the Chinese edition's Sphinx language: NAME.zh_CN.png


def english(en: str, zh: str) -> str:
    return en


def chinese(en: str, zh: str) -> str:
    return zh


# the memory meter's categories (labkit.memory.CATEGORIES, plot_timeline's legend), in Chinese
CATEGORIES_ZH = {"parameters": "参数", "buffers": "缓冲区", "gradients": "梯度",
                 "optimizer": "优化器状态", "activations": "激活值", "temporaries": "临时缓冲区"}
TECHNIQUES_ZH = {"activation checkpointing": "梯度检查点", "gradient accumulation": "梯度累积",
                 "mixed precision": "混合精度", "pipeline parallelism": "流水线并行",
                 "tensor parallelism": "张量并行", "sequence parallelism": "序列并行",
                 "context parallelism": "上下文并行", "mixture of experts": "混合专家"}

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


def memory_wall(path: Path, t=english) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    years = [g[1] for g in GPUS]
    base = GPUS[0]
    for idx, label, color in ((2, t("peak 16-bit FLOP/s", "16 位峰值 FLOP/s"), "#C44E52"),
                              (4, t("memory bandwidth", "显存带宽"), "#4C72B0"),
                              (3, t("memory capacity", "显存容量"), "#55A868")):
        rel = [g[idx] / base[idx] for g in GPUS]
        left.plot(years, rel, "o-", color=color, label=label)
        left.annotate(f"{rel[-1]:.1f}x", (years[-1], rel[-1]), textcoords="offset points", xytext=(6, -3),
                      fontsize=8, color=color)
    for name, year, *_ in GPUS:
        left.annotate(name, (year, 1), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    left.set_yscale("log")
    left.set_ylim(0.5, 20)
    left.set_xlim(2016.3, 2025.2)
    left.set_ylabel(t("relative to V100 (2017)", "相对 V100（2017）"))
    left.set_title(t("one datacenter GPU, from its datasheet", "单张数据中心 GPU（数据手册）"), fontsize=10)
    left.legend(fontsize=8, frameon=False, loc="upper left")

    for name, year, params in MODELS:
        gb = BYTES_PER_PARAM * params / 1e9
        right.scatter(year, gb, color="#8172B3", zorder=3)
        right.annotate(f"{name}\n{gb:,.0f} GB", (year, gb), textcoords="offset points", xytext=(6, -4),
                       fontsize=8)
    capacity = [GPU_MIB[g[0]] * MiB / 1e9 for g in GPUS]  # the driver's MiB, in 10^9 bytes
    right.step([g[1] for g in GPUS] + [2025], capacity + [capacity[-1]], where="post",
               color="#55A868", label=t("memory of one GPU (nvidia-smi's MiB, in GB)",
                     "单张 GPU 的显存（nvidia-smi 的 MiB，换算为 GB）"))
    right.set_yscale("log")
    right.set_xlim(2016.3, 2025.2)
    right.set_ylim(8, 1e4)
    right.set_ylabel("GB")
    right.set_title(t("model states at 16 bytes per parameter", "模型状态，每个参数 16 字节"),
                    fontsize=10)
    right.legend(fontsize=8, frameon=False, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def roofline(path: Path, t=english) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    intensity = [2.0 ** (k / 16) for k in range(-4 * 16, 12 * 16 + 1)]  # 1/16 ... 4096 FLOP/B
    colors = ["#8C8C8C", "#4C72B0", "#C44E52", "#55A868"]
    for (name, _, tflops, _, gbs), color in zip(GPUS, colors):
        attainable = [min(tflops, i * gbs / 1e3) for i in intensity]  # TFLOP/s
        ax.plot(intensity, attainable, color=color, label=t(f"{name}: ridge at {tflops * 1e3 / gbs:.0f} FLOP/B",
                                      f"{name}：拐点 {tflops * 1e3 / gbs:.0f} FLOP/B"))
        ax.plot([tflops * 1e3 / gbs], [tflops], "o", color=color, ms=4)
    # Two operators in bf16 (2 bytes per element): c = a + b reads 2 and writes 1 element per FLOP;
    # an n x n by n x n matmul does 2n^3 FLOPs on 3n^2 elements, n / 3 FLOP per byte.
    for x, text, side in ((1 / 6, t("elementwise add\n1/6 FLOP/B", "逐元素加法\n1/6 FLOP/B"), "left"),
                          (4096 / 3, t("matmul, n = 4096\nn/3 = 1365 FLOP/B",
                                       "矩阵乘法，n = 4096\nn/3 = 1365 FLOP/B"), "right")):
        ax.axvline(x, color="k", ls=":", lw=1)
        ax.text(x * (1.15 if side == "left" else 1 / 1.15), 0.15, text, fontsize=8, va="bottom", ha=side)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(t("arithmetic intensity (FLOP per byte of memory traffic)",
                    "算术强度（每字节显存访问的 FLOP）"))
    ax.set_ylabel(t("attainable TFLOP/s", "可达 TFLOP/s"))
    ax.set_ylim(0.1, 2000)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.set_title(t("the roofline: min(peak FLOP/s, intensity x bandwidth)",
                   "屋顶线模型：min(峰值 FLOP/s, 算术强度 × 带宽)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def activations(path: Path, t=english) -> None:
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
    ax.plot(seqs, linear, "o-", color="#4C72B0", label=t("terms in sbh (weights' inputs, MLP, masks, LN)",
                                                        "sbh 项（权重的输入、MLP、掩码、LN）"))
    ax.plot(seqs, quadratic, "o-", color="#C44E52", label=t("terms in as²b (attention scores, their dropout)",
                                                          "as²b 项（注意力分数及其 dropout）"))
    crossover = 34 * cfg.d_model / (5 * cfg.n_head)
    ax.axvline(crossover, color="k", ls=":", lw=1)
    ax.text(crossover * 1.08, min(quadratic), f"s = 34h / 5a = {crossover:.0f}", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(t("sequence length s", "序列长度 s"))
    ax.set_ylabel(t("GiB per layer, b = 1", "每层 GiB，b = 1"))
    ax.set_title(t(f"one layer with h = {cfg.d_model}, a = {cfg.n_head}, 16-bit activations",
                   f"单层，h = {cfg.d_model}，a = {cfg.n_head}，16 位激活值"), fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def step_timeline(path: Path, t=english) -> None:
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
    plot_timeline(step1, ax=axes[0], title=t("step 1: Adam's moments are created inside optimizer.step()",
                                             "第 1 步：Adam 的矩在 optimizer.step() 中创建"))
    plot_timeline(step2, ax=axes[1], title=t("step 2, and every step after it", "第 2 步及之后的每一步"))
    from labkit.book import CHINESE

    for ax in axes:  # the words plot_timeline writes: phases, categories, the axis
        for words, texts in ((CHINESE["phase"], ax.texts),
                             (CATEGORIES_ZH, ax.get_legend().get_texts())):
            for text in texts:
                text.set_text(t(text.get_text(), words.get(text.get_text(), text.get_text())))
        ax.set_xlabel(t(ax.get_xlabel(), "步内的算子序号"))
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
    ("mixture of experts", [(2017.0, "Shazeer et al. 2017-01"), (2020.45, "GShard 2020-06"),
                            (2021.0, "Switch 2021-01"), (2024.95, "DeepSeek-V3 2024-12")],
     "Megatron-Core, DeepSpeed"),
]


def timeline(path: Path, t=english) -> None:
    # Drawn at 8 inches for a page column of about 750 px: 9-point labels show at about 11 px.
    fig, ax = plt.subplots(figsize=(8, 7))
    for row, (technique, papers, systems) in enumerate(TIMELINE):
        y = len(TIMELINE) - row
        xs = [max(x, 2015.2) for x, _ in papers]
        ax.plot([xs[0], 2025.3], [y, y], color="#DDDDDD", lw=6, solid_capstyle="butt", zorder=1)
        for i, ((x, label), shown) in enumerate(zip(papers, xs)):
            ax.plot(shown, y, "o", color="#4C72B0" if x >= 2015 else "#8C8C8C", zorder=3)
            label = t(label, label.replace(" et al.", " 等人").replace("interleaved", "交错调度")
                      .replace("1F1B flush", "1F1B（flush）"))
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
    ax.set_yticks(range(1, len(TIMELINE) + 1),
                  [t(row[0], TECHNIQUES_ZH.get(row[0], row[0])) for row in reversed(TIMELINE)], fontsize=9)
    ax.set_xlim(2015, 2029.6)
    ax.set_xticks(range(2015, 2026, 2))
    ax.tick_params(axis="x", labelsize=9)
    ax.set_ylim(0.2, len(TIMELINE) + 0.8)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(t("first papers (dots: year-month of the first version)\n"
                   "right: the systems that made each technique common",
                   "最早的论文（圆点：第一版的年月）\n右侧：让每种技术普及的系统"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def collectives(path: Path, t=english) -> None:
    """Four ranks, a vector of four chunks each: reduce-scatter then all-gather (ring)."""
    n, colors = 4, ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
    titles = [t("before: rank r holds its gradient g_r\n(4 chunks)",
                "之前：rank r 持有自己的梯度 g_r\n（4 块）"),
              t("after reduce-scatter: rank r holds\nchunk r of the sum (sent 3 chunks)",
                "reduce-scatter 之后：rank r 持有\n总和的第 r 块（已发送 3 块）"),
              t("after all-gather: every rank holds\nthe whole sum (sent 3 more chunks)",
                "all-gather 之后：每个 rank 持有\n完整的总和（又发送 3 块）")]
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
        ax.set_xticks([c + 0.46 for c in range(n)], [t(f"chunk {c}", f"第 {c} 块") for c in range(n)], fontsize=7)
        ax.tick_params(length=0)
        ax.set_frame_on(False)
        ax.set_title(title, fontsize=8)
    fig.suptitle(t("all-reduce = reduce-scatter + all-gather: each rank sends (N-1)/N of the vector "
                   "in each half, 2(N-1)/N in all",
                   "all-reduce = reduce-scatter + all-gather：每个 rank 在每一半中发送向量的 (N-1)/N，"
                   "共 2(N-1)/N"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def zero_stages(path: Path, t=english) -> None:
    """Bytes per parameter per GPU against N_d (mixed-precision Adam, K = 12), and a 7.5B model."""
    ranks = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    per_param = {t("data parallelism", "数据并行"): lambda n: 16,
                 t("stage 1", "阶段 1"): lambda n: 4 + 12 / n,
                 t("stage 2", "阶段 2"): lambda n: 2 + 14 / n, t("stage 3", "阶段 3"): lambda n: 16 / n}
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
        ax.set_xlabel(t("data-parallel ranks $N_d$", "数据并行的 rank 数 $N_d$"))
        ax.legend(fontsize=8, frameon=False, loc="lower left")
    left.set_ylabel(t("bytes per parameter per GPU", "每张 GPU 上每个参数的字节数"))
    left.set_title(t("model states per GPU, mixed-precision Adam", "每张 GPU 的模型状态，混合精度 Adam"),
                   fontsize=9)
    right.set_ylabel(t("GB per GPU", "每张 GPU 的 GB"))
    right.set_title(t("a 7.5B-parameter model: which stage fits", "75 亿参数的模型：哪个阶段放得下"),
                    fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def token_weights(path: Path, t=english) -> None:
    """Chapter 4: a token's weight relative to the correct 1/N under the naive mean."""
    tokens = [180, 30, 120, 70]  # real tokens in each of k = 4 micro-batches
    k, total = len(tokens), sum(tokens)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = [total / (k * n) for n in tokens]
    ax.bar(range(k), bars, color="#C44E52", label=t("naive: mean per micro-batch, then / k",
                                                       "朴素做法：每个微批次取平均，再除以 k"))
    ax.axhline(1, color="#4C72B0", lw=2, label=t("window: sum / N (every token weighs 1/N)",
                                                             "窗口做法：求和 / N（每个 token 权重为 1/N）"))
    for i, (n, w) in enumerate(zip(tokens, bars)):
        ax.text(i, w + 0.05, f"{w:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(range(k), [t(f"micro-batch {i + 1}\n$N_{i + 1}$ = {n} tokens",
                               f"微批次 {i + 1}\n$N_{i + 1}$ = {n} 个 token")
                             for i, n in enumerate(tokens)], fontsize=8)
    ax.set_ylabel(t("weight of one token / (1/N)", "单个 token 的权重 / (1/N)"))
    ax.set_ylim(0, max(bars) * 1.25)
    ax.legend(fontsize=8, frameon=False, loc="upper right")
    ax.set_title(t(f"k = {k} micro-batches, N = {total} tokens: naive weight N / (k N_i)",
                   f"k = {k} 个微批次，N = {total} 个 token：朴素权重 N / (k N_i)"), fontsize=9)
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
    from labkit.book import chinese_figures

    for name in names:
        FIGURES[name](OUT / f"{name}.png", english)
        with chinese_figures():
            FIGURES[name](OUT / f"{name}.{LANGUAGE}.png", chinese)
        print("wrote", (OUT / f"{name}.png").relative_to(ROOT), "and", f"{name}.{LANGUAGE}.png")


if __name__ == "__main__":
    main()
