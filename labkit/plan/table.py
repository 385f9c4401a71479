"""The command line's tables: plans, the presets and the GPUs, as aligned text."""

from __future__ import annotations

import textwrap

from ..hardware import GPUS
from ..messages import pad, say, width
from ..shapes import PRESETS

__all__ = ["table", "training_table", "serving_table", "listing", "shape_summary", "shape_lines"]


def table(header: list, rows: list, sep: str = "  ") -> str:
    """Columns right-aligned to their widest cell (in display columns: a CJK character takes two),
    ``sep`` between them."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(width(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join(sep.join(pad(c, w, ">") for c, w in zip(r, widths)) for r in cells)


def _gb(n) -> str:
    return f"{n / 1e9:.1f}"


def training_table(result, top: int) -> str:
    """The best ``top`` plans within 80 columns: degrees, knobs, the per-GPU memory in GB (model
    states = parameters, gradients and optimizer states; other = the transient peaks and the memory
    outside PyTorch; ``--json`` keeps each apart), step time and MFU. ``zero`` reads "2+cpu" for
    ZeRO-Offload; ``ep`` is shown when a plan shards experts."""
    header = [say(f"table.train.{c}") for c in ("t", "p", "v", "dp", "cp", "zero", "recompute", "sp", "b", "m",
                                                  "states", "activ", "other", "total", "step", "mfu")]
    yes, no = say("table.yes"), say("table.no")
    rows = [[p.tp_size, p.pp_size, p.v, p.dp_size, p.cp_size, f"{p.zero_stage}+cpu" if p.offload else p.zero_stage,
             p.recompute, yes if p.sequence_parallel else no, p.micro_batch, p.num_microbatches,
             _gb(p.memory.params + p.memory.grads + p.memory.optimizer),
             _gb(p.memory.activations), _gb(p.memory.transient + p.memory.non_torch),
             _gb(p.memory.total), f"{p.step_time_s:.2f}", f"{p.mfu:.1%}"] for p in result.plans[:top]]
    if any(p.ep_size > 1 for p in result.plans[:top]):  # a model with experts: ep, inside dp
        header.insert(4, say("table.train.ep"))
        for row, p in zip(rows, result.plans):
            row.insert(4, p.ep_size)
    limit = result.plans[0].limit_bytes
    return (say("table.train.summary", fit=len(result.plans), considered=result.considered, limit=limit,
                shown=len(rows)) + "\n" + table(header, rows, sep=" "))


def serving_table(result, top: int) -> str:
    """Each tensor-parallel degree (and expert parallelism, "ep": experts whole, E/t a GPU): the
    weights a GPU holds, its KV blocks and tokens, requests a replica and in all."""
    header = [say(f"table.serve.{c}") for c in ("t", "ep", "replicas", "weights", "blocks", "tokens", "per_replica",
                                                  "requests", "bound")]
    on, off = say("table.on"), say("table.off")
    rows = [[p.tp_size, on if p.expert_parallel else off, p.replicas, _gb(p.estimate.weights), p.num_blocks,
             p.max_tokens, p.max_concurrency, p.total_concurrency, p.bound] for p in result.plans[:top]]
    return say("table.serve.summary", context_len=result.context_len) + "\n" + table(header, rows, sep=" ")


def listing(models: bool, gpus: bool) -> str:
    """The presets (layers, width, heads, parameters and those a token passes through) and/or the
    GPUs (memory, peak)."""
    out = []
    if models:
        out.append(table(["model", "layers", "d_model", "heads", "kv heads", "params", "active"],
                         [[n, s.n_layer, s.d_model, s.n_head, s.kv_heads, f"{s.num_params() / 1e9:.2f}B",
                           f"{s.active_params() / 1e9:.2f}B"] for n, s in PRESETS.items()]))
    if gpus:
        out.append("GPUs: memory GB is nvidia-smi's total in 10^9 bytes, of which plans use\n"
                   "--memory-fraction, beside the vendor's figure; dense tensor-core TFLOP/s,\n"
                   "\"-\" where the GPU has no tensor cores of that type.\n"
                   + table(["gpu", "memory GB", "vendor's", "fp16 TFLOP/s", "bf16 TFLOP/s", "link GB/s"],
                           [[n, f"{g.memory_bytes / 1e9:.1f}", f"{g.memory_gb:g} GB", _tflops(g, "fp16"),
                             _tflops(g, "bf16"), f"{g.link_gbps:g}"] for n, g in GPUS.items()]))
    return "\n\n".join(out)


def _tflops(g, dtype: str) -> str:
    return f"{g.peak[dtype] / 1e12:g}" if dtype in g.peak else "-"


def shape_summary(shape) -> dict:
    """What a shape is, in the numbers a reader checks against the model card (for --config)."""
    return {"params": shape.num_params(), "active_params": shape.active_params(), "n_layer": shape.n_layer,
            "d_model": shape.d_model, "n_head": shape.n_head, "n_kv_head": shape.kv_heads,
            "head_dim": shape.head_dim, "sliding_window": shape.sliding_window,
            "full_attention_every": shape.full_attention_every, "n_experts": shape.n_experts,
            "experts_per_token": shape.experts_per_token, "kv_lora_rank": shape.kv_lora_rank}


def _window(s) -> str:
    if s.sliding_window is None:
        return "no window"
    kind = "chunks" if s.chunked_attention else "a sliding window"
    if s.full_attention_every:
        k = s.full_attention_every
        return f"{kind} of {s.sliding_window} on {k - 1} layer(s) in {k}, the others full"
    return f"{kind} of {s.sliding_window} on every layer"


def shape_lines(shape, what: str, assumed) -> list:
    """The header ``--config`` prints: what was read (``what``), its counts and sizes, and each
    default ``assumed``; lines within 80 columns."""
    s = shape
    lines = [f"read {what}",
             f"  {s.num_params() / 1e9:.2f}B parameters, {s.active_params() / 1e9:.2f}B active a token; "
             f"{s.n_layer} layers, d_model {s.d_model}",
             f"  {s.n_head} heads, " + (f"MLA (cache {s.kv_cache_width()} a token a layer)" if s.kv_lora_rank
                                         else f"{s.kv_heads} KV heads") + f", head size {s.head_dim}",
             f"  {_window(s)}"]
    if s.n_experts:
        shared = f", {s.n_shared_experts} shared of {s.shared_dim}" if s.n_shared_experts else ""
        dense = sum(1 for i in range(s.n_layer) if not s.is_moe_layer(i))
        lines.append(f"  experts: {s.n_experts}, {s.experts_per_token} a token, width {s.expert_dim}{shared}; "
                     f"{dense} dense layer(s)")
    return lines + [line for a in assumed for line in textwrap.wrap(f"assumed: {a}", 80, subsequent_indent="  ")]
