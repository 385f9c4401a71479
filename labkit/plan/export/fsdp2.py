"""PyTorch FSDP2 (torch 2.13): a short script body (device mesh, TP/SP, checkpointing, fully_shard, pipeline)."""

from __future__ import annotations

from ...parallel.config import RunConfig
from ._common import note, refuse, run_of

__all__ = ["to_fsdp2", "MAPPING"]

# The plan's field -> fsdp2's setting (what the exporter writes).
MAPPING = {"dp_size, tp_size": "init_device_mesh(..., ('dp', 'tp'))", "tp_size, sequence_parallel":
           "parallelize_module (ColwiseParallel, RowwiseParallel, SequenceParallel)",
           "zero_stage=3": "fully_shard", "precision": "MixedPrecisionPolicy",
           "reshard_after_forward": "fully_shard(reshard_after_forward=)", "offload_params": "CPUOffloadPolicy",
           "recompute='full'": "checkpoint_wrapper", "pp_size, schedule": "torch.distributed.pipelining"}


_FSDP2_HEAD = '''\
# {summary}
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                    fully_shard)
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    parallelize_module)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper)

DP, TP, PP = {dp}, {tp}, {pp}
MICRO_BATCH, NUM_MICROBATCHES, SEQ_LEN = {b}, {m}, {s}


def tp_plan(sequence_parallel):
    """Megatron's split of a Llama block (torchtitan's names: attention.wq, wk,
    wv, wo; feed_forward.w1, w2, w3)."""
    out = Shard(1) if sequence_parallel else Replicate()
    plan = {{"attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=out),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=out)}}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                    desired_input_layouts=(Replicate(),))
        plan.update({{"attention_norm": SequenceParallel(),
                     "ffn_norm": SequenceParallel(),
                     "attention": gather, "feed_forward": gather}})
    return plan


def parallelize(model, device_type="cuda"):
    """TP (+SP), then activation checkpointing, then FSDP: torchtitan's order.
    ``model.layers`` holds the blocks; attention's heads are split over TP
    (set each block's local head count)."""
    mesh = init_device_mesh(device_type, (PP, DP, TP),
                            mesh_dim_names=("pp", "dp", "tp"))
'''

_FSDP2_SP = '''\
    # the sequence stays split between blocks: the embeddings' output, the
    # final norm, the head's input
    parallelize_module(model, mesh["tp"], {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Replicate())})
'''


def _fsdp2_body(run: RunConfig) -> str:
    """The body of ``parallelize``: only the steps this plan takes (TP, SP, checkpointing, FSDP)."""
    args = [f"reshard_after_forward={run.reshard_after_forward}"] + (
        ["offload_policy=CPUOffloadPolicy()"] if run.offload_params else [])

    def shard(what: str, indent: int) -> str:  # fully_shard(...), its options on hanging lines
        tail = f",\n{' ' * (indent + 4)}".join(args)
        return f"{' ' * indent}fully_shard({what}, mesh=mesh[\"dp\"], mp_policy=mp,\n{' ' * (indent + 4)}{tail})\n"
    lines = [_FSDP2_SP] if run.tp_size > 1 and run.sequence_parallel else []
    lines.append("    for i, block in enumerate(model.layers):\n")
    if run.tp_size > 1:
        lines.append(f"        parallelize_module(block, mesh[\"tp\"], tp_plan({run.sequence_parallel}))\n")
    if run.recompute == "full":
        lines.append("        block = model.layers[i] = checkpoint_wrapper(block)\n")
    if run.zero_stage == 3:
        lines.append(shard("block", 8))
        lines.append(shard("model", 4))
    elif lines[-1].startswith("    for "):
        lines.pop()
    return "".join(lines) + "    return model, mesh\n"


_FSDP2_PIPE = '''

def pipeline(stage_modules, mesh, loss_fn, device="cuda"):
    """This rank's {v} stage(s) of {stages} (module k is stage k x PP + its pp
    rank), run by {cls}."""
    from torch.distributed.pipelining import (PipelineStage,
                                              {cls})
    rank, group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    stages = [PipelineStage(module, k * PP + rank, {stages},
                            torch.device(device), group=group)
              for k, module in enumerate(stage_modules)]
    return {cls}(
        stages if len(stages) > 1 else stages[0], n_microbatches={m},
        loss_fn=loss_fn)
'''


def _fsdp2_check(run: RunConfig) -> None:
    if run.cp_size > 1:
        refuse("FSDP2", f"cp_size={run.cp_size} here: torch's context parallelism is experimental "
                "(torch.distributed.tensor.experimental.context_parallel); not emitted")
    if run.zero_stage in (1, 2) or (run.zero_stage == 0 and run.dp_size > 1):
        refuse("FSDP2", f"zero_stage={run.zero_stage} over dp_size={run.dp_size}: fully_shard is ZeRO-3 "
                "(ZeRO-0 is DistributedDataParallel, ZeRO-1 its ZeroRedundancyOptimizer)")
    if run.offload and not run.offload_params:
        refuse("FSDP2", "offload=True without offload_params: CPUOffloadPolicy moves the parameters too")
    if run.precision == "fp16-mixed":
        refuse("FSDP2", "precision='fp16-mixed' here: its loss scaling (ShardedGradScaler) is not emitted")
    if run.precision == "bf16-mixed-fp32-buffer":
        refuse("FSDP2", "precision='bf16-mixed-fp32-buffer' is DeepSpeed's BF16 optimizer, at ZeRO stage 0 or 1")
    if run.ep_size > 1:
        refuse("FSDP2", f"ep_size={run.ep_size}: expert parallelism is not emitted")
    if run.recompute == "selective":
        refuse("FSDP2", "recompute='selective': torch's per-op SAC (create_selective_checkpoint_contexts) "
                "needs a policy of its own")


def to_fsdp2(plan) -> str:
    """A short PyTorch script body: the device mesh, TP/SP through ``parallelize_module``,
    ``checkpoint_wrapper`` and ``fully_shard`` with a ``MixedPrecisionPolicy``, the pipeline schedule."""
    run = run_of(plan)
    _fsdp2_check(run)
    mixed = "MixedPrecisionPolicy(param_dtype=torch.bfloat16,\n" + " " * 30 + "reduce_dtype=torch.float32)"
    mp = {"bf16-mixed": mixed, "bf16-mixed-fp32-grads": mixed,
          "bf16": "MixedPrecisionPolicy()  # the model is bfloat16 itself", "fp32": "MixedPrecisionPolicy()"}
    summary = (f"labkit plan: dp={run.dp_size} tp={run.tp_size} pp={run.pp_size} v={run.v} ZeRO-{run.zero_stage} "
               f"recompute={run.recompute} sp={run.sequence_parallel} {run.precision}")
    text = _FSDP2_HEAD.format(summary=summary, dp=run.dp_size, tp=run.tp_size, pp=run.pp_size, b=run.micro_batch,
                              m=run.num_microbatches, s=run.seq_len)
    text += f"    mp = {mp[run.precision]}\n"
    text += _fsdp2_body(run)
    if run.pp_size > 1:
        cls = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}[run.schedule]
        text += _FSDP2_PIPE.format(v=run.v, cls=cls, m=run.num_microbatches, stages=run.pp_size * run.v)
        note("FSDP2", "export.fsdp2.stages")
    note("FSDP2", "export.fsdp2.loop", optimizer=run.optimizer, attention=run.attention)
    if run.precision == "bf16-mixed" and run.zero_stage == 3:
        note("FSDP2", "export.fsdp2.fp32_states")
    if run.tp_size > 1 and run.dp_size == 1:
        note("FSDP2", "export.fsdp2.embedding", tp_size=run.tp_size)
    return text
