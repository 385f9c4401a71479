"""Feed emitted configurations to the engines' own parsers, one engine a process (tests/test_export.py).

``python tests/engine_checks.py ENGINE`` reads a JSON list of cases on stdin, each
``{"config": ..., "world": {...}}``, and prints a JSON list: what the engine read back, or
``{"error": "..."}`` where its parser refused the case. Each engine needs a fresh process:
DeepSpeed and Megatron take their world from torch's fake process group, initialised once.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def _fake_world(world_size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def _device(offload) -> str:
    device = getattr(offload, "device", "none") if offload else "none"
    return str(getattr(device, "value", device))


def deepspeed_case(config: dict, world: dict) -> dict:
    """DeepSpeedConfig on ``config`` with the planner's data-parallel degree as its world."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    _fake_world(world["dp_size"])
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (the module object is taken from sys.modules below)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # the shared-memory op's 60 s JIT build
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.config import DeepSpeedConfig

    c = DeepSpeedConfig(config)
    zero = c.zero_config
    return {"train_batch_size": c.train_batch_size, "micro_batch": c.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": c.gradient_accumulation_steps, "zero_stage": c.zero_optimization_stage,
            "offload_optimizer": _device(zero.offload_optimizer), "offload_param": _device(zero.offload_param),
            "bf16": c.bfloat16_config.enabled, "fp16": c.float16_config.enabled, "grad_accum_dtype": c.grad_accum_dtype, "gradient_clipping": c.gradient_clipping,
            "pipeline_stages": c.pipeline["stages"], "autotp_size": c.tensor_parallel_config.autotp_size}


# Megatron-LM flag -> (megatron-core 0.16.1 config class, field): Megatron-LM's own parser builds its
# flags from these dataclasses' field names; the few it handles itself are named apart.
_MEGATRON_OWN = {"micro_batch_size", "global_batch_size", "seq_length", "max_position_embeddings", "vocab_size",
                 "group_query_attention", "swiglu", "position_embedding_type", "untie_embeddings_and_output_weights",
                 "disable_bias_linear", "grad_reduce_in_bf16", "use_megatron_fsdp",
                 "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
                 "num_experts"}  # Megatron-LM's --num-experts, TransformerConfig.num_moe_experts


def _megatron_flags(args: list) -> dict:
    out, i = {}, 0
    while i < len(args):
        name = args[i][2:].replace("-", "_")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[name], i = args[i + 1], i + 2
        else:
            out[name], i = True, i + 1
    return out


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _typed(cls, name, value):
    import dataclasses
    import typing

    hint = typing.get_type_hints(cls).get(name)
    default = {f.name: f.default for f in dataclasses.fields(cls)}[name]
    if value is True or hint is bool:
        return True
    if isinstance(default, int) or hint in (int, typing.Optional[int]):
        return int(value)
    if isinstance(default, float) or hint in (float, typing.Optional[float]):
        return float(value)
    return value


def megatron_case(args: list, world: dict) -> dict:
    """Megatron-core's TransformerConfig, DDP and optimizer configs, parallel_state and batch
    calculator, on the flags a Megatron-LM launch would read."""
    import dataclasses

    _fake_world(world["world_size"])
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator, get_num_microbatches,
                                                          init_num_microbatches_calculator)
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    flags, kw = _megatron_flags(args), {TransformerConfig: {}, DistributedDataParallelConfig: {}, OptimizerConfig: {}}
    for name, value in flags.items():
        owners = [c for c in kw if name in {f.name for f in dataclasses.fields(c)}]
        if not owners and name not in _MEGATRON_OWN:
            return {"error": f"unknown flag --{name.replace('_', '-')}"}
        for c in owners:
            kw[c][name] = _typed(c, name, value)
    t = kw[TransformerConfig]
    t.update(use_cpu_initialization=True, gated_linear_unit=bool(flags.get("swiglu")),
             add_bias_linear=not flags.get("disable_bias_linear"),
             virtual_pipeline_model_parallel_size=int(flags.get("num_virtual_stages_per_pipeline_rank", 0)) or None,
             num_query_groups=int(flags.get("num_query_groups", flags["num_attention_heads"])))
    t.pop("bf16", None), t.pop("fp16", None)
    import torch  # Megatron-LM's arguments.py sets both dtypes from --bf16/--fp16 the same way

    t["params_dtype"] = t["pipeline_dtype"] = (torch.bfloat16 if "bf16" in flags else
                                               torch.float16 if "fp16" in flags else torch.float32)
    config = TransformerConfig(bf16="bf16" in flags, fp16="fp16" in flags, **t)
    ddp = DistributedDataParallelConfig(**kw[DistributedDataParallelConfig],
                                        grad_reduce_in_fp32="bf16" in flags and "grad_reduce_in_bf16" not in flags)
    opt = dict(kw[OptimizerConfig])
    if opt.pop("use_precision_aware_optimizer", None) and not _has("transformer_engine"):
        pass  # its __post_init__ asks Transformer Engine's version, which has no CPU build: the name is checked
    OptimizerConfig(**opt)
    ps.initialize_model_parallel(config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                                 config.virtual_pipeline_model_parallel_size,
                                 context_parallel_size=config.context_parallel_size,
                                 expert_model_parallel_size=config.expert_model_parallel_size,
                                 create_gloo_process_groups=False)
    dp = ps.get_data_parallel_world_size()
    init_num_microbatches_calculator(0, None, int(flags["global_batch_size"]), int(flags["micro_batch_size"]), dp,
                                     False)
    out = {"tp_size": ps.get_tensor_model_parallel_world_size(), "pp_size": ps.get_pipeline_model_parallel_world_size(),
           "cp_size": ps.get_context_parallel_world_size(), "dp_size": dp, "v": config.virtual_pipeline_model_parallel_size,
           "num_microbatches": get_num_microbatches(), "sequence_parallel": config.sequence_parallel,
           "recompute": config.recompute_granularity, "distributed_optimizer": ddp.use_distributed_optimizer,
           "sharding": ddp.data_parallel_sharding_strategy, "bf16": config.bf16}
    ps.destroy_model_parallel()
    destroy_num_microbatches_calculator()
    return out


def torchtitan_case(args: list, world: dict) -> dict:
    """torchtitan's ConfigManager and ParallelDims on the emitted overrides (its debug model)."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    try:
        with redirect_stderr(err):
            cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *args])
    except SystemExit as e:  # tyro prints its error and exits
        return {"error": f"tyro refused the arguments (exit {e.code}): {' '.join(err.getvalue().split())[:600]}"}
    p, t = cfg.parallelism, cfg.training
    dims = ParallelDims.from_config(p, world_size=world["world_size"])
    ac = getattr(cfg, "activation_checkpoint", None)
    return {"dp_shard": dims.dp_shard, "dp_replicate": dims.dp_replicate, "tp_size": dims.tp, "pp_size": dims.pp,
            "cp_size": dims.cp, "ep_size": p.expert_parallel_degree, "local_batch_size": t.local_batch_size,
            "global_batch_size": t.global_batch_size, "microbatch": p.pipeline_parallel_microbatch_size,
            "schedule": p.pipeline_parallel_schedule, "sequence_parallel": p.enable_sequence_parallel,
            "reshard": p.fsdp_reshard_after_forward, "seq_len": t.seq_len, "ac": type(ac).__qualname__}


def accelerate_case(text: str, world: dict) -> dict:
    """accelerate's config loader on the emitted YAML, then its FSDP or DeepSpeed plugin and
    ParallelismConfig on what it read."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    cfg = load_config_from_file(f.name)
    os.unlink(f.name)
    out = {"distributed_type": str(cfg.distributed_type.value), "num_processes": cfg.num_processes,
           "mixed_precision": str(cfg.mixed_precision.value if hasattr(cfg.mixed_precision, "value") else cfg.mixed_precision)}
    if cfg.fsdp_config:
        f = cfg.fsdp_config
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=f["fsdp_version"], reshard_after_forward=f["fsdp_reshard_after_forward"],
            activation_checkpointing=f["fsdp_activation_checkpointing"], cpu_offload=f["fsdp_offload_params"],
            auto_wrap_policy=f["fsdp_auto_wrap_policy"].lower(), state_dict_type=f["fsdp_state_dict_type"],
            cpu_ram_efficient_loading=f["fsdp_cpu_ram_efficient_loading"])
        out.update(fsdp_version=plugin.fsdp_version, reshard=plugin.reshard_after_forward,
                   activation_checkpointing=plugin.activation_checkpointing)
    if cfg.deepspeed_config:
        d = cfg.deepspeed_config
        plugin = DeepSpeedPlugin(**d)
        out.update(zero_stage=plugin.zero_stage, gradient_accumulation_steps=plugin.gradient_accumulation_steps)
    pc = getattr(cfg, "parallelism_config", None) or {}
    if pc:
        from accelerate.parallelism_config import ParallelismConfig

        p = ParallelismConfig(**{k.replace("parallelism_config_", ""): v for k, v in pc.items()})
        out.update(tp_size=p.tp_size, cp_size=p.cp_size, total_size=p.total_size)
    return out


def megatron_flags_case(args: list, world: dict) -> dict:
    """The flags of a Megatron-LM command line that megatron-core 0.16.1's configs do not know
    (a chapter's fragment, without the model's own flags: names only)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    known = {f.name for c in (TransformerConfig, DistributedDataParallelConfig, OptimizerConfig)
             for f in dataclasses.fields(c)} | _MEGATRON_OWN
    return {"unknown": sorted(f"--{n.replace('_', '-')}" for n in _megatron_flags(args) if n not in known)}


def imports_case(source: str, world: dict) -> dict:
    """Run the imports of a Python fragment (its import statements alone) in this interpreter."""
    import ast

    tree = ast.parse(source)
    lines = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    try:
        exec("\n".join(lines), {})
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"imports": len(lines)}


CASES = {"deepspeed": deepspeed_case, "megatron": megatron_case, "torchtitan": torchtitan_case,
         "accelerate": accelerate_case, "megatron_flags": megatron_flags_case, "imports": imports_case}


def main() -> None:
    import io
    from contextlib import redirect_stdout

    fn, results = CASES[sys.argv[1]], []
    for case in json.load(sys.stdin):
        with redirect_stdout(io.StringIO()):  # the engines print; stdout carries the JSON answer
            try:
                results.append(fn(case["config"], case["world"]))
            except Exception as e:  # the engine's parser refused: say how
                results.append({"error": f"{type(e).__name__}: {e}"[:2000]})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
