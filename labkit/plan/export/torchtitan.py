"""torchtitan 0.3.0: command-line overrides (that release reads no TOML); --module/--config name the model."""

from __future__ import annotations

from ...parallel.config import RunConfig
from ._common import clip, note, refuse, run_of

__all__ = ["to_torchtitan", "MAPPING"]

# The plan's field -> torchtitan's setting (what the exporter writes).
MAPPING = {"dp_size (zero_stage 3)": "--parallelism.data-parallel-shard-degree",
           "dp_size (zero_stage 0)": "--parallelism.data-parallel-replicate-degree",
           "tp_size": "--parallelism.tensor-parallel-degree",
           "sequence_parallel": "--parallelism.[no-]enable-sequence-parallel",
           "pp_size": "--parallelism.pipeline-parallel-degree",
           "schedule, v": "--parallelism.pipeline-parallel-schedule",
           "micro_batch (pp > 1)": "--parallelism.pipeline-parallel-microbatch-size",
           "cp_size": "--parallelism.context-parallel-degree", "ep_size": "--parallelism.expert-parallel-degree",
           "reshard_after_forward": "--parallelism.fsdp-reshard-after-forward",
           "micro_batch x num_microbatches": "--training.local-batch-size / --training.global-batch-size",
           "seq_len": "--training.seq-len", "precision": "--training.mixed-precision-param / --training.dtype",
           "offload_params": "--training.enable-cpu-offload", "recompute": "activation-checkpoint:{mode}",
           "gradient_clipping": "--training.max-norm"}


def _titan_dp(run: RunConfig) -> list:
    if run.zero_stage in (1, 2):
        refuse("torchtitan", f"zero_stage={run.zero_stage}: it shards with FSDP (ZeRO-3, "
                "--parallelism.data-parallel-shard-degree) or replicates (ZeRO-0, data-parallel-replicate-degree)")
    shard, replicate = (run.dp_size, 1) if run.zero_stage == 3 else (1, run.dp_size)
    policy = "always" if run.reshard_after_forward else "never"
    if run.pp_size > 1 and run.reshard_after_forward and run.zero_stage == 3:
        note("torchtitan", "export.torchtitan.reshard", setting="--parallelism.fsdp-reshard-after-forward always")
    if run.offload and not run.offload_params:
        refuse("torchtitan", "offload=True without offload_params: --training.enable-cpu-offload moves the "
                "parameters too (FSDP's CPUOffloadPolicy)")
    return ["--parallelism.data-parallel-shard-degree", str(shard),
            "--parallelism.data-parallel-replicate-degree", str(replicate),
            "--parallelism.fsdp-reshard-after-forward", policy] + (
        ["--training.enable-cpu-offload"] if run.offload_params else [])


def _titan_pipeline(run: RunConfig, shape) -> list:
    """Pipeline flags; with v > 1 the layers a virtual stage holds, L / (p v), from ``shape``."""
    if run.pp_size == 1:
        return []
    schedule = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}[run.schedule]
    note("torchtitan", "export.torchtitan.stages")
    args = ["--parallelism.pipeline-parallel-degree", str(run.pp_size),
            "--parallelism.pipeline-parallel-schedule", schedule,
            "--parallelism.pipeline-parallel-microbatch-size", str(run.micro_batch),
            "--parallelism.pipeline-parallel-first-stage-less-layers", "0",
            "--parallelism.pipeline-parallel-last-stage-less-layers", "0"]
    if run.v > 1:
        if shape is None:
            refuse("torchtitan", f"v={run.v} without the model's layer count: it takes 2 stages a rank unless "
                   "--parallelism.pipeline-parallel-layers-per-stage says otherwise (give shape=)")
        args += ["--parallelism.pipeline-parallel-layers-per-stage", str(shape.n_layer // (run.pp_size * run.v))]
    return args


def _titan_precision(run: RunConfig) -> list:
    if run.precision == "fp16-mixed":
        refuse("torchtitan", "precision='fp16-mixed': it computes in bfloat16 or float32")
    if run.precision == "bf16":
        return ["--training.dtype", "bfloat16"]
    if run.precision == "fp32":
        return ["--training.mixed-precision-param", "float32"]
    if run.precision == "bf16-mixed-fp32-buffer":
        refuse("torchtitan", "precision='bf16-mixed-fp32-buffer' is DeepSpeed's BF16 optimizer; FSDP keeps its "
               "gradients in fp32 itself")
    note("torchtitan", "export.torchtitan.fp32_states")
    return ["--training.mixed-precision-param", "bfloat16", "--training.mixed-precision-reduce", "float32"]


def to_torchtitan(plan, *, shape=None, module: str | None = None, config: str | None = None,
                  gradient_clipping: float = 1.0) -> list:
    """torchtitan 0.3.0's command-line overrides (``--module``/``--config`` first when given;
    ``shape``, a ``ModelShape``, sizes an interleaved pipeline's virtual stages)."""
    run = run_of(plan)
    if run.attention == "eager":
        refuse("torchtitan", "attention='eager': its attention (FlexAttention, varlen) never stores the scores")
    if run.sequence_parallel and run.tp_size == 1:
        refuse("torchtitan", "sequence_parallel without tensor parallelism")
    local = run.micro_batch * (run.num_microbatches if run.pp_size > 1 else 1)
    args = (["--module", module, "--config", config] if module and config else []) + _titan_dp(run) + [
        "--parallelism.tensor-parallel-degree", str(run.tp_size),
        "--parallelism." + ("" if run.sequence_parallel or run.tp_size == 1 else "no-") + "enable-sequence-parallel",
        "--parallelism.context-parallel-degree", str(run.cp_size),
        "--parallelism.expert-parallel-degree", str(run.ep_size), *_titan_pipeline(run, shape),
        "--training.local-batch-size", str(local), "--training.global-batch-size", str(run.global_batch),
        "--training.seq-len", str(run.seq_len), "--training.max-norm", str(clip(gradient_clipping)),
        *_titan_precision(run)]
    if run.pp_size > 1:
        args.append("--training.disable-cuda-graphs")  # CUDA graphs refuse pipeline parallelism
    if run.recompute == "selective":
        note("torchtitan", "export.torchtitan.selective")
    if run.optimizer != "adamw":
        note("torchtitan", "export.torchtitan.optimizer", optimizer=run.optimizer)
    if not run.overlap_grad_reduce and run.dp_size > 1:
        note("torchtitan", "export.torchtitan.overlap")
    return args + [f"activation-checkpoint:{run.recompute}"]
