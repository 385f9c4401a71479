"""``python -m labkit.plan``: plan a training run or a server from the command line.

Exit status: 0 when plans are found, 1 when nothing fits (the reason on stderr, or in the JSON),
2 for bad usage (the argument named, with what would be valid).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from ..estimate import PRECISIONS
from ..hardware import GPUS, get_gpu
from ..memory.analytic import ATTENTION
from ..hf_config import FAMILIES, MULTIMODAL
from ..shapes import PRESETS, ModelShape
from .export import SERVING_ENGINES, TRAINING_ENGINES, export_best
from .planner import RECOMPUTE, plan_training
from .cli_serve import add_serve_arguments, serve_formats
from .cli_serve import serve as _serve

__all__ = ["main", "build_parser"]

EXAMPLES = """examples:
  python -m labkit.plan train --model llama-3-70b --gpu h100-sxm --num-gpus 64 --seq-len 8192 --global-batch 512
  python -m labkit.plan train --model llama-2-7b --gpu a100-80gb --num-gpus 1 --seq-len 4096 --global-batch 8 --top 3
  python -m labkit.plan train --model llama-3.1-405b --gpu h100-sxm --num-gpus 16384 --seq-len 131072 --global-batch 128 --cp 1,16
  python -m labkit.plan train --model llama-3-70b --gpu h100-sxm --num-gpus 64 --seq-len 8192 --global-batch 512 --emit megatron
  python -m labkit.plan train --model mixtral-8x7b --gpu h100-sxm --num-gpus 32 --seq-len 4096 --global-batch 256 --ep 1,2,4,8
  python -m labkit.plan serve --model llama-3-8b --gpu a100-80gb --context-len 4096
  python -m labkit.plan serve --model llama-3-8b --gpu a100-80gb --context-len 4096 --emit vllm --out serve.args
  python -m labkit.plan serve --config path/to/config.json --gpu h100-sxm --num-gpus 8 --context-len 8192 --json
  python -m labkit.plan serve --model mixtral-8x7b --gpu a100-80gb --context-len 4096 --weight-format fp8
  python -m labkit.plan serve --model deepseek-v3 --gpu h200 --num-gpus 8 --context-len 8192 --kv-format fp8
  python -m labkit.plan --list-models
  python -m labkit.plan --list-gpus

exit status: 0 plans found, 1 nothing fits (with the reason), 2 bad usage"""


def _ints(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"a preset: {', '.join(PRESETS)}")
    p.add_argument("--config", help="a Hugging Face config.json, read offline (in place of --model)")
    p.add_argument("--gpu", help=f"a GPU of labkit.hardware: {', '.join(GPUS)}")
    p.add_argument("--top", type=int, default=10, help="plans shown (default 10)")
    p.add_argument("--json", action="store_true", help='print {"plans": [...]} for scripts')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit.plan", epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Plan a training run or a server from labkit's estimator.")
    parser.add_argument("--list-models", action="store_true", help="list the model presets")
    parser.add_argument("--list-gpus", action="store_true", help="list the GPUs")
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser("train", help="plan a training run", epilog=EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(train)
    train.add_argument("--num-gpus", type=int, help="GPUs in the run")
    train.add_argument("--gpus-per-node", type=int, default=8,
                       help="GPUs a node, joined by NVLink: t divides it; across nodes, the network (default 8)")
    train.add_argument("--seq-len", type=int, help="tokens a sequence (required; no default: a model's "
                       "longest context is rarely the length it is trained at)")
    train.add_argument("--global-batch", type=int, help="sequences a step")
    train.add_argument("--micro-batches", type=_ints, default=(1, 2, 4, 8),
                       help="micro-batch sizes b to try, e.g. 1,2,4 (default 1,2,4,8)")
    train.add_argument("--zero-stages", type=_ints, default=(0, 1, 2, 3),
                       help="ZeRO stages to try, e.g. 0,1 (default 0,1,2,3)")
    train.add_argument("--recompute", default=",".join(RECOMPUTE),
                       help=f"recomputation to try, e.g. none,full (default {','.join(RECOMPUTE)})")
    train.add_argument("--cp", "--context-parallel", dest="context_parallel", type=_ints, default=None,
                       help="context-parallel degrees to try, e.g. 1,2,4 (default: 1, and powers of two from 16384 tokens)")
    train.add_argument("--ep", "--expert-parallel", dest="expert_parallel", type=_ints, default=None,
                       help="expert-parallel degrees to try for a model with experts, e.g. 1,8 (default: "
                       "every degree dividing the data-parallel ranks and the experts)")
    train.add_argument("--precision", default="bf16-mixed",
                       help=f"one of {', '.join(PRECISIONS)} (default bf16-mixed; a GPU without bf16, "
                       "the T4, takes fp16-mixed or fp32)")
    train.add_argument("--offload", action="store_true", help="weigh ZeRO-Offload too (states on the CPU)")
    train.add_argument("--efficiency", type=float, default=0.5,
                       help="share of the dense peak compute reaches (default 0.5)")
    train.add_argument("--network-gbps", type=float, default=None,
                       help="GB/s per GPU between nodes, one direction (default: the GPU's reference "
                       "cluster, 25 for A100, 50 for H100/H200: see --list-gpus)")
    train.add_argument("--attention", default="flash", choices=ATTENTION,
                       help="attention kernel: flash (scores never stored, default) or eager (labkit's model)")
    train.add_argument("--overlap-grad-reduce", action="store_true",
                       help="the gradient reduction runs under the backward (default: it adds to the step)")
    train.add_argument("--include-unrunnable", action="store_true",
                       help="also plan combinations labkit's mechanisms do not run yet (marked in --json)")
    train.add_argument("--memory-fraction", type=float, default=0.9,
                       help="share of the GPU's memory a plan may use (default 0.9)")
    _emit(train, TRAINING_ENGINES)
    serve = sub.add_parser("serve", help="plan a server", epilog=EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(serve)
    add_serve_arguments(serve)
    _emit(serve, SERVING_ENGINES)
    return parser


def _emit(p: argparse.ArgumentParser, engines) -> None:
    p.add_argument("--emit", choices=engines, help="print the configuration of the best plan this engine "
                   f"expresses ({', '.join(engines)}; the notes on stderr)")
    p.add_argument("--out", help="with --emit: write the configuration to this file instead")


def _shape(args, fail) -> tuple:
    """The shape of --model or --config, and the config.json read (None for a preset)."""
    if (args.model is None) == (args.config is None):
        fail("give one of --model (a preset) or --config (a config.json)")
    if args.model is not None:
        if args.model not in PRESETS:
            fail(f"--model {args.model!r} is unknown; valid presets: {', '.join(PRESETS)}")
        return PRESETS[args.model], None
    try:
        with open(args.config) as f:
            config = json.load(f)
        return ModelShape.from_hf_config(config), config
    except (OSError, json.JSONDecodeError, ValueError, TypeError) as e:
        fail(f"--config {args.config!r}: {e}")


def _assumed(args, shape, config: dict) -> list:
    """Each default the plan takes for what --config and the flags leave unsaid."""
    out = [] if "model_type" in config else ["no model_type: read as a llama config.json"]
    out += [shape.source] if shape.source else []
    c = config.get("text_config", config) if config.get("model_type") in MULTIMODAL else config
    family = c.get("model_type", "llama")
    if "num_key_value_heads" not in c:
        out.append("no num_key_value_heads: multi-head attention")
    if "tie_word_embeddings" not in c and "tie_word_embeddings" not in config:
        out.append(f"no tie_word_embeddings: {'tied' if FAMILIES[family][2] else 'untied'} ({family}'s default)")
    if c.get("sliding_window") is not None and c.get("use_sliding_window", True) is False:
        out.append(f"sliding_window {c['sliding_window']} not applied: use_sliding_window is false")
    if shape.n_mtp_layers:
        out.append(f"{shape.n_mtp_layers} multi-token-prediction layer(s) not counted")
    if args.command == "train":
        out += [f"the weights stored as {shape.weight_format}, trained in --precision {args.precision}"
                ] if shape.weight_format else []
    else:
        out.append(serve_formats(args, shape))
    return out


def _required(args, fail, names, hints=None) -> None:
    """Refuse the missing flags of ``names`` by name, each with its ``hints`` entry if any."""
    missing = [f"--{n.replace('_', '-')}{(hints or {}).get(n, '')}" for n in names if getattr(args, n) is None]
    if missing:
        fail(f"the following arguments are required: {', '.join(missing)}")
    if args.gpu is None:
        fail(f"--gpu is required; valid: {', '.join(GPUS)}")
    if args.top < 1:
        fail(f"--top {args.top} must be at least 1")


def _train(args, fail, shape):
    # --seq-len has no default: the model's longest context is rarely the length a run trains at
    _required(args, fail, ("num_gpus", "seq_len", "global_batch"),
              {"seq_len": f" (no default: this model reads up to {shape.seq_len} tokens)"})
    return plan_training(shape, gpu=args.gpu, num_gpus=args.num_gpus, gpus_per_node=args.gpus_per_node,
                         seq_len=args.seq_len, global_batch=args.global_batch,
                         micro_batches=args.micro_batches, zero_stages=args.zero_stages,
                         recompute=tuple(args.recompute.split(",")), efficiency=args.efficiency,
                         precision=args.precision, offload=(False, True) if args.offload else (False,),
                         network_gbps=args.network_gbps, memory_fraction=args.memory_fraction,
                         context_parallel=args.context_parallel, attention=args.attention,
                         expert_parallel=args.expert_parallel,
                         overlap_grad_reduce=args.overlap_grad_reduce, include_unrunnable=args.include_unrunnable)


def train_assumptions(args, shape=None) -> list:
    """What a training plan assumes beyond the flags given: the kernel, the network, the overlap,
    and for ``shape`` with experts or MLA the one tensor-parallel degree weighed (t = 1)."""
    g = get_gpu(args.gpu)
    net = (f"network {args.network_gbps:g} GB/s a GPU (--network-gbps)" if args.network_gbps is not None
           else f"network {g.network_gbps:g} GB/s a GPU ({g.name}'s reference cluster; --network-gbps)")
    return [f"attention {args.attention} (--attention)", net,
            f"compute at {args.efficiency:g} of the dense peak (--efficiency)",
            "gradient reduction " + ("under the backward" if args.overlap_grad_reduce else
                                     "after the backward, not overlapped (--overlap-grad-reduce)"),
            "only what labkit runs" + (" and what it does not (--include-unrunnable)" if args.include_unrunnable
                                       else " (--include-unrunnable for the rest)")] + _one_tp(shape)


def _one_tp(shape) -> list:
    """Why a model with experts or MLA is planned with t = 1 only (``labkit.plan.sweep.layouts``)."""
    why = [name for name, present in (("experts", shape is not None and shape.n_experts),
                                      ("MLA", shape is not None and shape.kv_lora_rank)) if present]
    return [f"t = 1 only ({' and '.join(why)}: the estimate models them on one tensor-parallel rank; "
            "no context parallelism with MLA)" if "MLA" in why else
            "t = 1 only (experts: the estimate models them on one tensor-parallel rank)"] if why else []


def _as_flags(message: str, args) -> str:
    """``num_gpus=0 must ...`` -> ``--num-gpus 0 must ...`` for the options this command has."""
    for name in vars(args):
        message = message.replace(f"{name}=", f"--{name.replace('_', '-')} ")
    return message


def _emit_config(args, fail, result, shape, read) -> int:
    """Print (or write to --out) the configuration --emit names, of the best plan it expresses."""
    if args.out is not None and args.json:
        fail("--out writes the configuration alone: give it without --json")
    options = {"megatron": {"shape": shape}, "torchtitan": {"shape": shape}, "vllm": {"model": args.model or args.config},
               "accelerate": {"gpus_per_node": getattr(args, "gpus_per_node", 8)}}.get(args.emit, {})
    try:
        index, out, refused = export_best(result.plans, args.emit, **options)
    except ValueError as e:
        print(f"--emit {args.emit}: {e}", file=sys.stderr)
        return 1
    said = [f"plan {index + 1} of {len(result.plans)}" + (f" (the better ones refused: {refused[0]})" if refused
                                                          else " (the best)")] + out.notes
    if args.json:
        print(json.dumps({**result.to_dict(), "plans": [p.to_dict() for p in result.plans[:args.top]], **read,
                          "emit": {**out.to_dict(), "plan_index": index, "refused": refused}}, indent=1))
        return 0
    if args.out is not None:
        with open(args.out, "w") as f:
            f.write(out.text + "\n")
    else:
        print(out.text)
    print("\n".join(f"# {line}" for line in said), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    """The command line, in English whatever language labkit prints in (labkit.messages.use)."""
    from ..messages import using

    with using("en"):
        return _main(argv)


def _main(argv) -> int:
    from .table import listing, serving_table, shape_lines, shape_summary, training_table

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_models or args.list_gpus:
        print(listing(args.list_models, args.list_gpus))
        return 0
    if args.command is None:
        parser.error("choose a command: train or serve (or --list-models, --list-gpus)")
    fail = parser._subparsers._group_actions[0].choices[args.command].error
    shape, config = _shape(args, fail)
    read = {}
    if config is not None:  # say what was read, and what was assumed
        assumed = _assumed(args, shape, config)
        read = {"model": {**shape_summary(shape), "config": args.config, "assumed": assumed}}
        if not args.json:
            print("\n".join(shape_lines(shape, f"{args.config} ({config.get('model_type', 'no model_type')})",
                                        assumed)))
    try:
        result = _train(args, fail, shape) if args.command == "train" else _serve(args, fail, shape, _required)
    except ValueError as e:  # the library's checks name the argument; say it as the flag
        fail(_as_flags(str(e), args))
    shown = result.plans[:args.top]
    if getattr(args, "emit", None) and result.plans:
        return _emit_config(args, fail, result, shape, read)
    if args.json:
        assumed = {"assumed": train_assumptions(args, shape)} if args.command == "train" else {}
        print(json.dumps({**result.to_dict(), "plans": [p.to_dict() for p in shown], **read, **assumed,
                          **({} if result.plans else {"reason": result.reason()})}, indent=1))
    elif shown:
        print((training_table if args.command == "train" else serving_table)(result, args.top))
        if args.command == "serve" and config is None:
            print(textwrap.fill(f"assumed: {serve_formats(args, shape)}", 80, subsequent_indent="  "))
        if args.command == "train":
            print(textwrap.fill("assumed: " + "; ".join(train_assumptions(args, shape)), 80, subsequent_indent="  "))
    if not result.plans:
        print(f"nothing fits: {result.reason()}", file=sys.stderr)
        return 1
    return 0
