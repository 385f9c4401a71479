"""The command line's tables: plans, the presets and the GPUs, as aligned text."""

from __future__ import annotations

from ..hardware import GPUS
from ..shapes import PRESETS

__all__ = ["table", "training_table", "serving_table", "listing"]


def table(header: list, rows: list) -> str:
    """Columns right-aligned to their widest cell."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def _gb(n) -> str:
    return f"{n / 1e9:.1f}"


def training_table(result, top: int) -> str:
    """The best ``top`` plans: degrees, knobs, the per-GPU memory in GB, step time and MFU."""
    header = ["t", "p", "v", "dp", "cp", "zero", "recompute", "sp", "offload", "b", "m", "params", "grads", "optim",
              "activ", "trans", "total GB", "step s", "MFU"]
    rows = [[p.tp_size, p.pp_size, p.v, p.dp_size, p.cp_size, p.zero_stage, p.recompute,
             "yes" if p.sequence_parallel else "no", "yes" if p.offload else "no", p.micro_batch, p.num_microbatches,
             *(_gb(getattr(p.memory, k)) for k in ("params", "grads", "optimizer", "activations", "transient")),
             _gb(p.memory.total), f"{p.step_time_s:.2f}", f"{p.mfu:.1%}"] for p in result.plans[:top]]
    limit = result.plans[0].limit_bytes
    return (f"{len(result.plans)} of {result.considered} configurations fit in {_gb(limit)} GB a GPU; "
            f"the best {len(rows)}:\n" + table(header, rows))


def serving_table(result, top: int) -> str:
    """Each tensor-parallel degree: blocks and tokens a GPU, requests a replica and in all."""
    header = ["t", "replicas", "KV blocks/GPU", "tokens/GPU", "requests/replica", "requests", "bound"]
    rows = [[p.tp_size, p.replicas, p.num_blocks, p.max_tokens, p.max_concurrency, p.total_concurrency, p.bound]
            for p in result.plans[:top]]
    return f"requests of {result.context_len} tokens served at once:\n" + table(header, rows)


def listing(models: bool, gpus: bool) -> str:
    """The presets (layers, width, heads, parameters) and/or the GPUs (memory, peak)."""
    out = []
    if models:
        out.append(table(["model", "layers", "d_model", "heads", "kv heads", "params"],
                         [[n, s.n_layer, s.d_model, s.n_head, s.kv_heads, f"{s.num_params() / 1e9:.2f}B"]
                          for n, s in PRESETS.items()]))
    if gpus:
        out.append(table(["gpu", "memory GB", "bf16 TFLOP/s", "link GB/s"],
                         [[n, g.memory_gb, f"{g.peak.get('bf16', g.peak.get('fp16', 0)) / 1e12:g}", g.link_gbps]
                          for n, g in GPUS.items()]))
    return "\n\n".join(out)
