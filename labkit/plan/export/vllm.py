"""vLLM: the arguments of `vllm serve` (option names of vLLM 0.8.5's engine arguments)."""

from __future__ import annotations

from ...estimate.formats import QUANT_METHODS
from ._common import note, refuse

__all__ = ["to_vllm", "MAPPING", "QUANTIZATION"]

# The plan's field -> vllm's setting (what the exporter writes).
MAPPING = {"tp_size": "--tensor-parallel-size", "replicas": "--data-parallel-size",
           "context_len": "--max-model-len", "gpu_memory_utilization": "--gpu-memory-utilization",
           "block_size": "--block-size", "kv_bytes": "--kv-cache-dtype", "weight_bytes": "--dtype",
           "max_num_seqs": "--max-num-seqs", "weight_format": "--quantization (--dtype for 16-bit)",
           "kv_format": "--kv-cache-dtype"}
# A weight format -> the --quantization value that stores a checkpoint so (fp8: vLLM quantizes a
# 16-bit checkpoint as it loads, one scale a matrix; awq and gptq read a checkpoint stored so).
QUANTIZATION = {"fp8": "fp8", "fp8-per-tensor": "fp8", "int4-awq": "awq", "int4-gptq": "gptq"}


def _dtype_of_bytes(weight_bytes: int) -> str:
    dtype = {2: "bfloat16", 4: "float32"}.get(weight_bytes)
    if dtype is None:
        refuse("vLLM", f"weight_bytes={weight_bytes} as --dtype (2 or 4); quantized weights are "
               "--quantization, which changes what a weight costs: plan with a weight_format")
    return dtype


def _weights(fmt: str | None, weight_bytes, checkpoint: str | None) -> tuple:
    """(--dtype, the --quantization arguments) of a weight format, or of bytes a weight."""
    if fmt is None:
        return _dtype_of_bytes(weight_bytes), []
    if fmt in ("bf16", "fp16"):
        return {"bf16": "bfloat16", "fp16": "float16"}[fmt], []
    if QUANT_METHODS.get(checkpoint) == fmt:
        note("vLLM", "export.vllm.stored", fmt=fmt)
        return "bfloat16", []
    if fmt not in QUANTIZATION:
        refuse("vLLM", f"weight_format={fmt!r} of a checkpoint stored otherwise: vLLM reads {fmt} from a "
               "checkpoint stored so (serve that checkpoint) and quantizes on the fly only to fp8")
    if fmt == "fp8":
        note("vLLM", "export.vllm.fp8")
    if fmt.startswith("int4"):
        note("vLLM", "export.vllm.int4", method=QUANTIZATION[fmt])
    return "bfloat16", ["--quantization", QUANTIZATION[fmt]]


def _kv(kv_format, kv_bytes, dtype: str) -> str:
    if kv_format is not None:
        return "fp8" if kv_format == "fp8" else "auto"
    kv = {1: "fp8", 2: "auto", 4: "auto"}.get(kv_bytes)
    if kv is None or (kv_bytes == 4 and dtype != "float32") or (kv_bytes == 2 and dtype == "float32"):
        refuse("vLLM", f"kv_bytes={kv_bytes} with --dtype {dtype}: --kv-cache-dtype auto is the weights' "
               "dtype, fp8 is 1 byte")
    return kv


def to_vllm(plan, *, model: str | None = None, context_len: int | None = None, gpu_memory_utilization=None,
            kv_bytes: int | None = None, weight_bytes: int | None = None, max_num_seqs: int | None = None) -> list:
    """``vllm serve`` arguments for a ``ServingPlan`` (its settings; a keyword overrides one)."""
    settings = {k: (v if v is not None else getattr(plan, k, None)) for k, v in
                dict(context_len=context_len, gpu_memory_utilization=gpu_memory_utilization,
                     max_num_seqs=max_num_seqs).items()}
    missing = [k for k, v in settings.items() if v is None]
    if not hasattr(plan, "tp_size") or not hasattr(plan, "estimate") or missing:
        raise ValueError(f"plan={type(plan).__name__} must be a labkit.plan.ServingPlan carrying {missing or 'its'} "
                         "settings (plan_serving's plans do), or give them as keywords")
    if getattr(plan, "expert_parallel", False):
        refuse("vLLM", "expert_parallel=True: the option that shards experts whole is not among vLLM 0.8.5's "
               "engine arguments this exporter writes")
    fmt = None if weight_bytes is not None else getattr(plan, "weight_format", None)
    wb = weight_bytes if weight_bytes is not None else getattr(plan, "weight_bytes", None)
    dtype, quant = _weights(fmt, 2 if fmt is None and wb is None else wb, getattr(plan, "checkpoint_format", None))
    kv_format = None if kv_bytes is not None else getattr(plan, "kv_format", None)
    kb = kv_bytes if kv_bytes is not None else getattr(plan, "kv_bytes", None)
    kv = _kv(kv_format, 2 if kv_format is None and kb is None else kb, dtype)
    args = ([model] if model else []) + [
        "--tensor-parallel-size", str(plan.tp_size), "--pipeline-parallel-size", "1",
        "--data-parallel-size", str(getattr(plan, "replicas", 1)), "--dtype", dtype, *quant,
        "--max-model-len", str(settings["context_len"]), "--gpu-memory-utilization",
        f"{settings['gpu_memory_utilization']:g}", "--block-size", str(plan.estimate.block_size),
        "--kv-cache-dtype", kv, "--max-num-seqs", str(settings["max_num_seqs"])]
    note("vLLM", "export.vllm.memory")
    if getattr(plan.estimate, "layer_windows", ()) and len(set(plan.estimate.layer_windows)) > 1 and \
            plan.estimate.window_cache == "per_layer":
        note("vLLM", "export.vllm.windows")
    return args
