"""``python -m labkit.plan serve``'s options and plan: formats, expert parallelism, windows."""

from __future__ import annotations

from ..estimate.formats import KV_FORMATS, WEIGHT_FORMATS, default_weight_format
from ..estimate.serving import WINDOW_CACHES
from .serving import plan_serving

__all__ = ["add_serve_arguments", "serve", "serve_formats"]


def add_serve_arguments(serve) -> None:
    """The ``serve`` subcommand's own options (the model, GPU and output options are shared)."""
    serve.add_argument("--num-gpus", type=int, default=1,
                       help="GPUs serving the model: tensor-parallel groups of t, the rest replicas (default 1)")
    serve.add_argument("--context-len", type=int,
                       help="tokens of one request, prompt and output (at most the model's)")
    serve.add_argument("--weight-format", choices=tuple(WEIGHT_FORMATS),
                       help="how the weights are stored, scales and 16-bit tensors counted (default: the "
                       "config's quantization_config, else bf16)")
    serve.add_argument("--kv-format", choices=tuple(KV_FORMATS), help="the KV cache's elements (default bf16)")
    serve.add_argument("--weight-bytes", type=int, help="bytes every parameter takes, in place of --weight-format")
    serve.add_argument("--kv-bytes", type=int, help="bytes a cached key or value element, in place of --kv-format")
    serve.add_argument("--expert-parallel", choices=("both", "on", "off"), default="both",
                       help="a mixture of experts: shard the experts whole over a replica's t GPUs (on), slice "
                       "each by t (off), or plan both (default)")
    serve.add_argument("--window-cache", choices=WINDOW_CACHES, default="per_layer",
                       help="per-layer windows: each layer caches its window (per_layer, vLLM's hybrid KV cache "
                       "manager, default) or every layer the whole context (full, vLLM before it)")
    serve.add_argument("--block-size", type=int, default=16, help="tokens a KV block (default 16, vLLM's)")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="share of the GPU's memory the server may use (default 0.9, vLLM's)")


def serve_formats(args, shape) -> str:
    """What a serving plan stores its weights and KV cache in, and why (the flag, or the default)."""
    if args.weight_bytes is not None:
        weights = f"weights at --weight-bytes {args.weight_bytes} a parameter"
    elif args.weight_format is not None:
        weights = f"weights in {args.weight_format} (--weight-format)"
    elif shape.weight_format:
        try:
            weights = (f"weights in {default_weight_format(shape)}, the config's quantization_config "
                       f"({shape.weight_format}); --weight-format to change")
        except ValueError:
            weights = f"weights stored as {shape.weight_format}, not modelled: give --weight-format"
    else:
        weights = "weights in bf16 (--weight-format to change)"
    kv = f"KV at --kv-bytes {args.kv_bytes}" if args.kv_bytes is not None else \
        f"KV cache in {args.kv_format or 'bf16'}" + ("" if args.kv_format else " (--kv-format)")
    return f"{weights}; {kv}"


def serve(args, fail, shape, required):
    """The serving plans the options ask for; ``fail`` reports bad usage, ``required`` checks
    the flags every command needs."""
    required(args, fail, ("context_len",))
    for fmt, raw in (("weight_format", "weight_bytes"), ("kv_format", "kv_bytes")):
        if getattr(args, fmt) is not None and getattr(args, raw) is not None:
            fail(f"give one of --{fmt.replace('_', '-')} and --{raw.replace('_', '-')}")
    ep = {"both": (False, True), "on": (True,), "off": (False,)}[args.expert_parallel]
    if not shape.n_experts and args.expert_parallel == "on":
        fail("--expert-parallel on needs a mixture of experts; this model is dense")
    return plan_serving(shape, gpu=args.gpu, num_gpus=args.num_gpus, context_len=args.context_len,
                        weight_bytes=args.weight_bytes, kv_bytes=args.kv_bytes, weight_format=args.weight_format,
                        kv_format=args.kv_format, expert_parallel=ep if shape.n_experts else (False,),
                        window_cache=args.window_cache, block_size=args.block_size,
                        gpu_memory_utilization=args.gpu_memory_utilization)
