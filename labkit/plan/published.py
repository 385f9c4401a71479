"""The published runs the book cites, each described as it ran, and the planner's model of them.

Torch-free. A :class:`PublishedRun` is a model shape, a cluster and a ``RunConfig`` holding the
settings the run reported (its sources are named), with the published throughput (TFLOP/s a GPU,
counted as the source counts it: ``hfu`` with the recomputed forward, or ``mfu`` without) and, where
reported, memory a GPU. :func:`model_run` puts the estimator and the step-time model beside them,
with the model's error. What the model assumed of a run and what it cannot express are said in its ``notes``:
English text, each a :class:`Note` that :meth:`PublishedRun.note_texts` says in another language.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..estimate import training_memory
from ..hardware import get_gpu, peak_flops
from ..messages import current, render
from ..parallel.config import RunConfig
from ..shapes import PRESETS, ModelShape
from .steptime import step_time

__all__ = ["PublishedRun", "Note", "PUBLISHED", "NARAYANAN_TABLE1", "narayanan_run", "model_run"]


class Note(str):
    """A note on a published run: its English text (``labkit.messages``' ``kind`` with ``fields``),
    a str as any note, that :meth:`text` renders in another language."""

    def __new__(cls, kind: str, **fields):
        note = super().__new__(cls, render(kind, "en", **fields))
        note.kind, note.fields = kind, fields
        return note

    def __getnewargs_ex__(self):  # copy and pickle make it again from its kind and fields
        return (self.kind,), self.fields

    def text(self, lang=None) -> str:
        """The note in ``lang`` (None: the language labkit prints in now, ``labkit.messages.current``)."""
        return render(self.kind, current() if lang is None else lang, **self.fields)


@dataclass(frozen=True)
class PublishedRun:
    """A run as published: what ran (``shape``, ``gpu``, ``num_gpus``, ``run``), on what network
    (GB/s a GPU, one direction), and what was reported (``tflops`` a GPU counted as ``counts``,
    ``memory_gb`` a GPU or None), with ``source`` and ``notes``: what the model assumed of it and
    what it leaves out, in English (:meth:`note_texts` in any language)."""

    name: str
    shape: ModelShape
    gpu: str
    num_gpus: int
    run: RunConfig
    network_gbps: float
    tflops: float
    counts: str
    source: str
    memory_gb: float | None = None
    notes: tuple = ()

    def note_texts(self, lang=None) -> tuple:
        """The notes in ``lang`` (None: the language labkit prints in now); a note given as plain
        text is said as given."""
        return tuple(n.text(lang) if isinstance(n, Note) else n for n in self.notes)


BLOOM = ModelShape(n_layer=70, d_model=14336, n_head=112, vocab_size=250880, seq_len=2048, pos="rope")  # ALiBi: no parameters
L405 = PRESETS["llama-3.1-405b"]

PUBLISHED = {
    "bloom-176b": PublishedRun(
        "BLOOM-176B", BLOOM, "a100-80gb", 384,
        RunConfig(dp_size=8, tp_size=4, pp_size=12, micro_batch=2, num_microbatches=128, seq_len=2048,
                  zero_stage=1, recompute="full", precision="bf16-mixed-fp32-buffer", attention="eager"),
        6.25, 150.0, "hfu",
        "bigscience-workshop/bigscience train/tr11-176B-ml (slurm script: TP 4, PP 12, MBS 2, GBS 2048, "
        "--checkpoint-activations, BF16 optimizer with its unsharded fp32 gradient buffer; logs: 149-150 "
        "TFLOP/s); 'one copy of the model takes 48 GPUs (using 60 GB of memory on each GPU)'",
        60.0, (Note("published.bloom.network"), Note("published.bloom.attention"))),
    "llama3-405b-8k": PublishedRun(
        "Llama 3 405B, 8K", L405.replace(seq_len=8192), "h100-sxm", 8192,
        RunConfig(dp_size=64, tp_size=8, pp_size=16, micro_batch=1, num_microbatches=32, seq_len=8192, v=2,
                  zero_stage=3, reshard_after_forward=False, recompute="none", kernels="fused",
                  precision="bf16-mixed-fp32-grads", sequence_parallel=True, overlap_grad_reduce=True),
        50.0, 430.0, "mfu",
        "Grattafiori et al. 2024 (arXiv 2407.21783v3), Table 4 and Section 3.3.2: 8,192 GPUs, TP 8, PP 16, "
        "DP 64, 32 sequences a DP rank, no activation checkpointing, interleaved schedule, FSDP without "
        "resharding after forward, fp32 gradients; 430 TFLOP/s a GPU, 43% BF16 MFU",
        None, (Note("published.llama3.interleave"), Note("published.llama3.fused"), Note("published.llama3.stages"),
               Note("published.llama3.network"))),
    "llama3-405b-128k": PublishedRun(
        "Llama 3 405B, 128K", L405, "h100-sxm", 16384,
        RunConfig(dp_size=8, tp_size=8, pp_size=16, cp_size=16, micro_batch=1, num_microbatches=16, v=2,
                  seq_len=131072, zero_stage=3, reshard_after_forward=False, recompute="none", kernels="fused",
                  precision="bf16-mixed-fp32-grads", sequence_parallel=True, overlap_grad_reduce=True),
        50.0, 380.0, "mfu",
        "Grattafiori et al. 2024 (arXiv 2407.21783v3), Table 4: 16,384 GPUs, TP 8, CP 16, PP 16, DP 8, "
        "16 sequences of 131,072 tokens a DP rank; 380 TFLOP/s a GPU, 38% BF16 MFU",
        None, (Note("published.llama3.all_gather"), Note("published.llama3.assumed_128k"))),
}

# Narayanan et al. (2021b), Table 1: (parameters in B, heads, hidden, layers, t, p, GPUs, batch,
# achieved TFLOP/s a GPU counting the recomputed forward), sequences of 2048, V = 51,200
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def narayanan_run(row, v: int = 1) -> PublishedRun:
    """A row of Table 1 as the paper ran it: full recomputation, b = 1 (not published per row:
    assumed), the interleaved schedule with ``v`` chunks where the pipeline has stages, pipeline
    messages scattered over t (scatter/gather), A100 80 GB on Selene's 200 Gb/s a GPU."""
    size, a, h, L, t, p, n, batch, tflops = row
    dp = n // (t * p)
    shape = ModelShape(n_layer=L, d_model=h, n_head=a, vocab_size=51200, seq_len=2048)
    v = v if p > 1 and (batch // dp) % p == 0 else 1
    run = RunConfig(dp_size=dp, tp_size=t, pp_size=p, micro_batch=1, num_microbatches=batch // dp, seq_len=2048,
                    v=v, recompute="full", attention="eager", precision="fp16-mixed")
    return PublishedRun(f"GPT {size}B", shape, "a100-80gb", n, run, 25.0, float(tflops), "hfu",
                        "Narayanan et al. 2021b, Table 1 and Section 5.1", None,
                        (Note("published.narayanan.micro_batch", micro_batch=run.micro_batch),))


def model_run(case: PublishedRun, efficiency: float = 0.5, gpus_per_node: int = 8) -> dict:
    """The estimator's memory and the step-time model's throughput for ``case``, beside what was
    published: ``tflops`` (counted as the source counts), ``tflops_error`` (model / published - 1),
    ``memory_gb`` and ``memory_error`` where memory was reported, ``mfu``, ``hfu`` and ``bubble``."""
    g = get_gpu(case.gpu)
    run = case.run.check(case.shape)
    mem = training_memory(case.shape, run)
    peak = peak_flops(g, "fp16" if run.precision.startswith("fp16") else "bf16")
    step = step_time(run, case.shape, num_gpus=case.num_gpus, gpus_per_node=gpus_per_node, peak=peak,
                     efficiency=efficiency, nvlink_gbps=g.link_gbps / 2, network_gbps=case.network_gbps)
    tflops = (step.hfu if case.counts == "hfu" else step.mfu) * peak / 1e12
    out = {"name": case.name, "tflops": tflops, "published_tflops": case.tflops,
           "tflops_error": tflops / case.tflops - 1, "mfu": step.mfu, "hfu": step.hfu, "bubble": step.bubble,
           "memory_gb": mem.total / 1e9, "published_memory_gb": case.memory_gb, "fits": mem.total <= g.memory_bytes,
           "step_s": step.total_s}
    out["memory_error"] = None if case.memory_gb is None else out["memory_gb"] / case.memory_gb - 1
    return out
