"""Megatron-LM: the arguments of pretrain_gpt.py (flags of Megatron-LM's main branch, core_r0.19)."""

from __future__ import annotations

from ...parallel.config import RunConfig
from ._common import clip, note, refuse, run_of

__all__ = ["to_megatron", "MAPPING"]

# The plan's field -> megatron's setting (what the exporter writes).
MAPPING = {"tp_size": "--tensor-model-parallel-size", "pp_size": "--pipeline-model-parallel-size",
           "v": "--num-virtual-stages-per-pipeline-rank", "cp_size": "--context-parallel-size",
           "ep_size": "--expert-model-parallel-size", "sequence_parallel": "--sequence-parallel",
           "recompute": "--recompute-granularity/--recompute-method/--recompute-num-layers",
           "zero_stage=1": "--use-distributed-optimizer",
           "zero_stage=2/3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads[_params]",
           "micro_batch": "--micro-batch-size", "dp_size x micro_batch x num_microbatches": "--global-batch-size",
           "precision": "--bf16 / --fp16 / --grad-reduce-in-bf16", "offload": "--optimizer-cpu-offload",
           "attention": "--attention-backend", "overlap_grad_reduce": "--overlap-grad-reduce",
           "seq_len": "--seq-length", "optimizer": "--optimizer", "gradient_clipping": "--clip-grad"}


def _megatron_stages(run: RunConfig, shape) -> list:
    """Pipeline flags: the degree, interleaving, an uneven first or last stage."""
    args = ["--pipeline-model-parallel-size", str(run.pp_size)]
    if run.v > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(run.v)]
    if run.schedule == "gpipe" and run.num_microbatches >= run.pp_size > 1:
        refuse("Megatron-LM", f"schedule='gpipe' with num_microbatches={run.num_microbatches} >= "
                f"pp_size={run.pp_size}: it runs 1F1B (or interleaved 1F1B)")
    if shape is not None and run.pp_size > 1 and shape.n_layer % run.pp_size:
        extra, first = shape.n_layer % run.pp_size, shape.n_layer // run.pp_size + 1
        if extra != 1:
            refuse("Megatron-LM", f"the plan's stages ({extra} of {run.pp_size} stages hold one layer more of "
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
            refuse("Megatron-LM", "reshard_after_forward=False: Megatron-FSDP has no such switch")
    if run.offload_params:
        refuse("Megatron-LM", "offload_params=True: it offloads the optimizer only (--optimizer-cpu-offload)")
    if run.offload:  # its hybrid-device optimizer runs on the precision-aware optimizer's code path
        args += ["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0"]
        note("Megatron-LM", "export.megatron.offload")
    if run.precision == "bf16":
        refuse("Megatron-LM", "precision='bf16' (no fp32 master copy)")
    if run.precision == "bf16-mixed-fp32-buffer":
        refuse("Megatron-LM", "precision='bf16-mixed-fp32-buffer' is DeepSpeed's BF16 optimizer: Megatron-LM adds "
               "each gradient into its fp32 main_grad as it is made (precision='bf16-mixed-fp32-grads')")
    args += {"bf16-mixed": ["--bf16", "--grad-reduce-in-bf16"], "bf16-mixed-fp32-grads": ["--bf16"],
             "fp16-mixed": ["--fp16"], "fp32": []}[run.precision]
    return args


def _megatron_model(shape) -> list:
    """The model's own flags for a dense GPT or Llama block; for any other, none, and a note saying so."""
    pos = {"rope": "rope", "learned": "learned_absolute"}.get(shape.pos)
    beyond = list(shape.features()) + ([] if pos else [f"pos={shape.pos!r}"]) + (
        [] if shape.mlp in ("swiglu", "gelu") else [f"mlp={shape.mlp!r}"])
    if beyond:
        note("Megatron-LM", "export.megatron.model_flags", beyond=beyond)
        return []
    args = ["--num-layers", str(shape.n_layer), "--hidden-size", str(shape.d_model), "--ffn-hidden-size",
            str(shape.d_ff), "--num-attention-heads", str(shape.n_head), "--max-position-embeddings",
            str(shape.seq_len), "--vocab-size", str(shape.vocab_size)]
    if shape.kv_heads != shape.n_head:
        args += ["--group-query-attention", "--num-query-groups", str(shape.kv_heads)]
    args += (["--swiglu"] if shape.mlp == "swiglu" else []) + (["--normalization", "RMSNorm"]
                                                               if shape.norm == "rmsnorm" else [])
    args += ["--position-embedding-type", pos]
    args += ([] if shape.tie_embeddings else ["--untie-embeddings-and-output-weights"])
    return args + ([] if shape.bias else ["--disable-bias-linear"])


def to_megatron(plan, *, shape=None, gradient_clipping: float = 1.0) -> list:
    """Megatron-LM ``pretrain_gpt.py`` arguments (with the model's own flags when ``shape`` is given)."""
    run = run_of(plan)
    args = ["--tensor-model-parallel-size", str(run.tp_size), *_megatron_stages(run, shape),
            "--context-parallel-size", str(run.cp_size)]
    if run.ep_size > 1:
        args += ["--expert-model-parallel-size", str(run.ep_size)]
    args += ["--sequence-parallel"] if run.sequence_parallel else []
    args += _megatron_memory(run)
    args += ["--micro-batch-size", str(run.micro_batch), "--global-batch-size", str(run.global_batch),
             "--seq-length", str(run.seq_len), "--attention-backend",
             "unfused" if run.attention == "eager" else "flash", "--clip-grad", str(clip(gradient_clipping))]
    args += ["--optimizer", "sgd" if run.optimizer.startswith("sgd") else "adam"]
    args += ["--sgd-momentum", "0"] if run.optimizer == "sgd" else []
    if run.optimizer == "adam":
        args += ["--weight-decay", "0"]  # Megatron's adam decouples weight decay (AdamW); none is Adam
    args += ["--overlap-grad-reduce"] if run.overlap_grad_reduce else []
    return (_megatron_model(shape) if shape is not None else []) + args
