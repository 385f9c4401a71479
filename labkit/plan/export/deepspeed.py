"""DeepSpeed (0.19.8): a ds_config.json, as a dict."""

from __future__ import annotations

from ...parallel.config import RunConfig
from ._common import clip, note, refuse, run_of

__all__ = ["to_deepspeed", "MAPPING"]

# The plan's field -> deepspeed's setting (what the exporter writes).
MAPPING = {"dp_size x micro_batch x num_microbatches": "train_batch_size",
           "micro_batch": "train_micro_batch_size_per_gpu", "num_microbatches": "gradient_accumulation_steps",
           "zero_stage": "zero_optimization.stage", "offload": "zero_optimization.offload_optimizer.device",
           "offload_params": "zero_optimization.offload_param.device",
           "overlap_grad_reduce": "zero_optimization.overlap_comm", "precision": "bf16 / fp16 / data_types",
           "recompute='full'": "activation_checkpointing", "pp_size": "PipelineModule(num_stages=...)",
           "tp_size": "tensor_parallel.autotp_size", "optimizer": "optimizer.type",
           "gradient_clipping": "gradient_clipping"}


def _ds_precision(run: RunConfig) -> dict:
    p = run.precision
    if p == "bf16":
        refuse("DeepSpeed", "precision='bf16' (no fp32 master copy): its bf16 optimizer keeps fp32 master "
                "weights; use precision='bf16-mixed'")
    out = {"bf16": {"enabled": p.startswith("bf16")}, "fp16": {"enabled": p == "fp16-mixed"}}
    if p == "fp16-mixed":
        out["fp16"].update(loss_scale=0, initial_scale_power=16)  # dynamic loss scaling
    if p in ("bf16-mixed-fp32-grads", "bf16-mixed-fp32-buffer"):
        if run.zero_stage == 0:  # its engine's optimizer check raises on this mix without ZeRO
            refuse("DeepSpeed", f"precision={p!r} with zero_stage=0: it accumulates bf16 gradients in fp32 only "
                   "under ZeRO (at stage 1 as its BF16 optimizer)")
        out["data_types"] = {"grad_accum_dtype": "fp32"}
        if p == "bf16-mixed-fp32-grads" and run.zero_stage == 1 and not run.offload:
            note("DeepSpeed", "export.deepspeed.bf16_optimizer", precision="bf16-mixed-fp32-buffer")
    elif p == "bf16-mixed" and run.zero_stage in (1, 2):
        note("DeepSpeed", "export.deepspeed.fp32_partition")
    return out


def _ds_zero(run: RunConfig) -> dict:
    if run.zero_stage == 3 and not run.reshard_after_forward:
        refuse("DeepSpeed", "reshard_after_forward=False: ZeRO-3 gathers each parameter again in the backward")
    zero = {"stage": run.zero_stage, "overlap_comm": run.overlap_grad_reduce, "contiguous_gradients": True}
    if run.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if run.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def _ds_layout(run: RunConfig) -> dict:
    """The pipeline and tensor-parallel blocks, refusing what DeepSpeed's engines do not run."""
    if run.cp_size > 1:
        refuse("DeepSpeed", f"cp_size={run.cp_size} (ring attention): its sequence parallelism is Ulysses' "
                "all-to-all over heads (sequence_parallel_size), a different mechanism")
    if run.sequence_parallel:
        refuse("DeepSpeed", "sequence_parallel=True: AutoTP training does not shard the norms' and dropouts' "
                "activations over the tensor-parallel ranks")
    out = {}
    if run.tp_size > 1:
        out["tensor_parallel"] = {"autotp_size": run.tp_size}
    if run.pp_size > 1:
        if run.zero_stage >= 2:
            refuse("DeepSpeed", f"zero_stage={run.zero_stage} with pp_size={run.pp_size}: its PipelineEngine runs "
                    "ZeRO-0 or ZeRO-1 only")
        if run.v > 1 or (run.schedule == "gpipe" and run.num_microbatches >= run.pp_size):
            refuse("DeepSpeed", f"schedule={run.schedule!r} (v={run.v}): its PipelineEngine runs 1F1B only")
        out["pipeline"] = {"activation_checkpoint_interval": int(run.recompute == "full")}
        note("DeepSpeed", "export.deepspeed.pipeline",
             module=f"deepspeed.pipe.PipelineModule(layers, num_stages={run.pp_size}, partition_method='uniform')")
    if run.ep_size > 1:
        note("DeepSpeed", "export.deepspeed.experts", ep_size=run.ep_size)
    return out


def to_deepspeed(plan, *, gradient_clipping: float = 1.0) -> dict:
    """A ``ds_config.json`` (as a dict) for DeepSpeed's ``deepspeed.initialize(config=...)``."""
    run = run_of(plan)
    cfg = {"train_batch_size": run.global_batch, "train_micro_batch_size_per_gpu": run.micro_batch,
           "gradient_accumulation_steps": run.num_microbatches, "gradient_clipping": clip(gradient_clipping),
           **_ds_precision(run), "zero_optimization": _ds_zero(run), **_ds_layout(run)}
    if run.optimizer in ("adamw", "adam"):
        cfg["optimizer"] = {"type": {"adamw": "AdamW", "adam": "Adam"}[run.optimizer]}
    else:
        cfg["optimizer"] = {"type": "SGD", "params": {"momentum": 0.9 if run.optimizer == "sgd_momentum" else 0.0}}
    if run.recompute == "full":
        cfg["activation_checkpointing"] = {"partition_activations": run.tp_size > 1, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False}
        note("DeepSpeed", "export.deepspeed.full")
    elif run.recompute == "selective":
        note("DeepSpeed", "export.deepspeed.selective")
    if run.attention == "eager":
        note("DeepSpeed", "export.deepspeed.eager")
    note("DeepSpeed", "export.deepspeed.yours", seq_len=run.seq_len)
    return cfg
