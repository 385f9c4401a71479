"""vLLM: the arguments of `vllm serve`."""

from __future__ import annotations

from ._common import note, refuse

__all__ = ["to_vllm", "MAPPING"]

# The plan's field -> vllm's setting (what the exporter writes).
MAPPING = {"tp_size": "--tensor-parallel-size", "replicas": "--data-parallel-size",
           "context_len": "--max-model-len", "gpu_memory_utilization": "--gpu-memory-utilization",
           "block_size": "--block-size", "kv_bytes": "--kv-cache-dtype", "weight_bytes": "--dtype",
           "max_num_seqs": "--max-num-seqs"}


def to_vllm(plan, *, model: str | None = None, context_len: int | None = None, gpu_memory_utilization=None,
            kv_bytes: int | None = None, weight_bytes: int | None = None, max_num_seqs: int | None = None) -> list:
    """``vllm serve`` arguments for a ``ServingPlan`` (its settings; a keyword overrides one)."""
    settings = {k: (v if v is not None else getattr(plan, k, None)) for k, v in
                dict(context_len=context_len, gpu_memory_utilization=gpu_memory_utilization, kv_bytes=kv_bytes,
                     weight_bytes=weight_bytes, max_num_seqs=max_num_seqs).items()}
    missing = [k for k, v in settings.items() if v is None]
    if not hasattr(plan, "tp_size") or not hasattr(plan, "estimate") or missing:
        raise ValueError(f"plan={type(plan).__name__} must be a labkit.plan.ServingPlan carrying {missing or 'its'} "
                         "settings (plan_serving's plans do), or give them as keywords")
    dtype = {2: "bfloat16", 4: "float32"}.get(settings["weight_bytes"])
    if dtype is None:
        refuse("vLLM", f"weight_bytes={settings['weight_bytes']} as --dtype (2 or 4); quantized weights are "
                "--quantization, which changes what a weight costs")
    kv = {1: "fp8", 2: "auto", 4: "auto"}[settings["kv_bytes"]] if settings["kv_bytes"] in (1, 2, 4) else None
    if kv is None or (settings["kv_bytes"] == 4 and dtype != "float32") or (settings["kv_bytes"] == 2 and dtype != "bfloat16"):
        refuse("vLLM", f"kv_bytes={settings['kv_bytes']} with weight_bytes={settings['weight_bytes']}: "
                "--kv-cache-dtype auto is the weights' dtype, fp8 is 1 byte")
    args = ([model] if model else []) + [
        "--tensor-parallel-size", str(plan.tp_size), "--pipeline-parallel-size", "1",
        "--data-parallel-size", str(getattr(plan, "replicas", 1)), "--dtype", dtype,
        "--max-model-len", str(settings["context_len"]), "--gpu-memory-utilization",
        f"{settings['gpu_memory_utilization']:g}", "--block-size", str(plan.estimate.block_size),
        "--kv-cache-dtype", kv, "--max-num-seqs", str(settings["max_num_seqs"])]
    note("vLLM", "bfloat16 stands for any 2-byte dtype (float16 too); vLLM profiles a forward at start-up and "
          "gives the KV cache what remains of --gpu-memory-utilization, as the plan's estimate does")
    return args
