"""Hugging Face accelerate (1.16): the YAML of `accelerate config`, as a dict."""

from __future__ import annotations

from ...parallel.config import RunConfig
from ...validate import check_int
from ._common import clip, note, refuse, run_of

__all__ = ["to_accelerate", "MAPPING"]

# The plan's field -> accelerate's setting (what the exporter writes).
MAPPING = {"zero_stage=3": "distributed_type FSDP, fsdp_config (fsdp_version 2)",
           "zero_stage=1/2": "distributed_type DEEPSPEED, deepspeed_config.zero_stage",
           "zero_stage=0": "distributed_type MULTI_GPU", "world_size": "num_processes",
           "precision": "mixed_precision", "reshard_after_forward": "fsdp_config.fsdp_reshard_after_forward",
           "recompute='full'": "fsdp_config.fsdp_activation_checkpointing",
           "offload_params": "fsdp_config.fsdp_offload_params",
           "tp_size, cp_size, dp_size": "parallelism_config.parallelism_config_{tp,cp,dp_shard,dp_replicate}_size"}


def _accelerate_fsdp(run: RunConfig) -> dict:
    return {"fsdp_version": 2, "fsdp_reshard_after_forward": run.reshard_after_forward,
            "fsdp_activation_checkpointing": run.recompute == "full", "fsdp_offload_params": run.offload_params,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True}


def _accelerate_deepspeed(run: RunConfig, max_norm: float) -> dict:
    return {"zero_stage": run.zero_stage, "gradient_accumulation_steps": run.num_microbatches,
            "gradient_clipping": max_norm, "offload_optimizer_device": "cpu" if run.offload else "none",
            "offload_param_device": "none", "zero3_init_flag": False}


def to_accelerate(plan, *, gpus_per_node: int = 8, gradient_clipping: float = 1.0) -> dict:
    """An ``accelerate`` config (the YAML of ``accelerate config``, as a dict): FSDP2 for ZeRO-3,
    its DeepSpeed plugin for ZeRO-1/2, DDP for ZeRO-0; TP and CP in ``parallelism_config``."""
    run, max_norm = run_of(plan), clip(gradient_clipping)
    check_int("gpus_per_node", gpus_per_node, 1)
    if run.ep_size > 1:
        refuse("accelerate", f"ep_size={run.ep_size}: it has no expert parallelism")
    if run.sequence_parallel:
        refuse("accelerate", "sequence_parallel=True: its tensor parallelism (the model's tp_plan) has no "
               "switch for it")
    if run.pp_size > 1:
        refuse("accelerate", f"pp_size={run.pp_size}: it trains without pipeline parallelism")
    if run.precision in ("bf16", "bf16-mixed-fp32-grads", "bf16-mixed-fp32-buffer"):
        refuse("accelerate", f"precision={run.precision!r}: mixed_precision is bf16, fp16 or no")
    if run.offload and run.zero_stage == 3 and not run.offload_params:
        refuse("accelerate", "offload without offload_params under FSDP (fsdp_offload_params moves all states)")
    if (run.tp_size > 1 or run.cp_size > 1) and run.zero_stage != 3:
        refuse("accelerate", f"tp_size={run.tp_size}, cp_size={run.cp_size} with zero_stage={run.zero_stage}: "
                "its parallelism_config composes TP and CP with FSDP2 (zero_stage=3)")
    if run.recompute == "selective" or (run.recompute == "full" and run.zero_stage != 3):
        refuse("accelerate", f"recompute={run.recompute!r} here: fsdp_activation_checkpointing (full, under "
                "FSDP) is its switch; otherwise model.gradient_checkpointing_enable()")
    machines = -(-run.world_size // gpus_per_node)
    cfg = {"compute_environment": "LOCAL_MACHINE", "num_machines": machines, "num_processes": run.world_size,
           "machine_rank": 0, "main_training_function": "main", "use_cpu": False, "rdzv_backend": "static",
           "same_network": True, "mixed_precision": {"bf16-mixed": "bf16", "fp16-mixed": "fp16",
                                                     "fp32": "no"}[run.precision]}
    if run.zero_stage == 3:
        cfg.update(distributed_type="FSDP", fsdp_config=_accelerate_fsdp(run))
    elif run.zero_stage in (1, 2):
        cfg.update(distributed_type="DEEPSPEED", deepspeed_config=_accelerate_deepspeed(run, max_norm))
    else:
        cfg["distributed_type"] = "MULTI_GPU" if run.world_size > 1 else "NO"
    if run.tp_size > 1 or run.cp_size > 1:
        shard, rep = (run.dp_size, 1) if run.zero_stage == 3 else (1, run.dp_size)
        cfg["parallelism_config"] = {"parallelism_config_dp_replicate_size": rep,
                                     "parallelism_config_dp_shard_size": shard,
                                     "parallelism_config_tp_size": run.tp_size,
                                     "parallelism_config_cp_size": run.cp_size}
    if machines > 1:
        note("accelerate", "export.accelerate.machines", machines=machines, gpus_per_node=gpus_per_node)
    note("accelerate", "export.accelerate.loop", micro_batch=run.micro_batch, seq_len=run.seq_len,
         num_microbatches=run.num_microbatches, max_norm=max_norm, optimizer=run.optimizer)
    return cfg
