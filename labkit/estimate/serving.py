"""KV-cache capacity of a served model, per GPU, by vLLM's rule (Kwon et al. 2023).

vLLM gives the KV cache what is left of ``gpu_memory_utilization`` x the GPU's memory after the
weights, the peak of a forward and the memory PyTorch does not manage. It measures the last two
by profiling; this estimate assumes them (see :func:`serving_memory`). Bytes per token come from
``labkit.paged_attention.analytic.kv_bytes_per_token`` (2 L n_kv head_dim e: grouped-query
attention counted; under MLA L (kv_lora_rank + qk_rope_head_dim) e, ``ModelShape.kv_cache_width``);
a window caps the tokens a layer caches. Every expert's weights count, in a named format
(:mod:`labkit.estimate.formats`). Windows that differ by layer (Gemma 2, gpt-oss, Llama 4) are
sized as vLLM's hybrid KV cache manager sizes them (``window_cache="per_layer"``; its design
notes, references.bib ``vllmhybridkv``): a windowed layer caches at most its window, a full layer
the whole context. ``window_cache="full"`` is vLLM with that manager disabled, whose
``FullAttentionSpec`` then allocates every layer's blocks for all tokens (vllm.v1.kv_cache_interface,
read in its v0.9 documentation), as vLLM did before the manager existed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

from ..hardware import get_gpu
from ..memory.runtime import CONTEXT_BYTES, ring_peers
from ..memory.runtime import non_torch_bytes as outside_bytes
from ..paged_attention.analytic import blocks_for_tokens, cached_tokens, kv_bytes_per_token
from ..shape_rules import layer_window
from ..validate import ArgumentError, check_bool, check_choice, check_float, check_int
from .formats import KV_FORMATS, default_weight_format, params_per_rank
from .formats import weight_bytes as format_bytes
from .report import breakdown
from .training import as_shape

__all__ = ["ServingEstimate", "serving_memory", "check_context_len", "NON_TORCH_BYTES", "PROFILE_TOKENS",
           "WINDOW_CACHES"]

NON_TORCH_BYTES = CONTEXT_BYTES  # one GPU's memory outside PyTorch: labkit.memory.runtime (vLLM measures it)
PROFILE_TOKENS = 8192  # tokens of vLLM's profiling forward: its max_num_batched_tokens, assumed 8192
WINDOW_CACHES = ("per_layer", "full")  # vLLM's hybrid KV cache manager; every layer the whole context


@dataclass(frozen=True)
class ServingEstimate:
    """Per GPU: the budget (utilisation x memory), weights, forward peak, non-PyTorch memory, the
    KV cache's bytes, its ``num_blocks`` of ``block_size`` tokens (every layer's) and ``max_tokens``;
    ``layer_windows``: each layer's window (None: the whole context), ``bytes_per_block`` split
    evenly over the layers; the formats and whether the experts are sharded whole (expert_parallel)."""

    gpu: str
    budget: int
    weights: int
    activation_peak: int
    non_torch: int
    kv_cache: int
    bytes_per_block: int
    block_size: int
    sliding_window: int | None = None
    layer_windows: tuple = ()
    weight_format: str | None = None
    kv_format: str | None = None
    expert_parallel: bool = False
    window_cache: str = "per_layer"

    @property
    def num_blocks(self) -> int:
        return self.kv_cache // self.bytes_per_block

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, context_len: int) -> int:
        """Sequences of ``context_len`` tokens whose caches fit at once: whole blocks in each layer,
        a windowed layer's holding only its window's tokens (vLLM's hybrid KV cache manager)."""
        check_int("context_len", context_len, 1)
        windows = self.layer_windows or (self.sliding_window,)
        per_layer = self.bytes_per_block // len(windows)
        need = sum(blocks_for_tokens(cached_tokens(_Window(w), context_len), self.block_size) for w in windows)
        return (self.kv_cache // per_layer) // need

    def to_dict(self) -> dict:
        return {**asdict(self), "num_blocks": self.num_blocks, "max_tokens": self.max_tokens}

    def __str__(self) -> str:
        parts = {"weights": self.weights, "activation_peak": self.activation_peak,
                 "non_pytorch": self.non_torch, "kv_cache": self.kv_cache}
        return breakdown(("serving", {"gpu": self.gpu}), parts, self.budget,
                         (("blocks", {"num_blocks": self.num_blocks, "block_size": self.block_size,
                                      "max_tokens": self.max_tokens}),))


class _Window(NamedTuple):
    sliding_window: int | None


def check_context_len(shape, context_len: int) -> None:
    """Refuse a request longer than the model reads: ``context_len`` tokens in 1..``shape.seq_len``
    (its ``max_position_embeddings``)."""
    check_int("context_len", context_len, 1)
    shape = as_shape(shape)
    if context_len > shape.seq_len:
        raise ArgumentError(f"context_len={context_len} must be at most the model's seq_len={shape.seq_len}",
                            "context_len", context_len=context_len, seq_len=shape.seq_len)


def serving_memory(shape, *, gpu, tp_size: int = 1, weight_bytes: int | None = None, kv_bytes: int | None = None,
                   weight_format: str | None = None, kv_format: str | None = None, expert_parallel: bool = False,
                   window_cache: str = "per_layer", block_size: int = 16, gpu_memory_utilization: float = 0.9,
                   profile_tokens: int = PROFILE_TOKENS, non_torch_bytes: int | None = None) -> ServingEstimate:
    """The KV cache one GPU of ``tp_size`` holds, by vLLM's rule.

    budget = ``gpu_memory_utilization`` x memory; KV cache = budget - weights (this rank's, in
    ``weight_format``, :func:`labkit.estimate.formats.weight_bytes`; or every parameter x the
    older ``weight_bytes``; neither: the config's format, else bf16) - forward peak -
    ``non_torch_bytes`` (None: the CUDA context and, over t > 1 ranks, NCCL's buffers,
    ``labkit.memory.runtime``). The forward peak is assumed, not profiled: vLLM's profiling batch
    of ``profile_tokens`` tokens, without autograd and with a FlashAttention-style kernel, holds one
    layer's residual stream, norm output and attention output (3h a token) and its MLP's gate and up
    outputs (2 d_ff/t; with experts the k chosen and the shared: ``active_ffn_dim``), in 16-bit
    activations (``weight_bytes`` bytes if given). KV elements: ``kv_format`` (or ``kv_bytes``).
    """
    shape = as_shape(shape)
    g = get_gpu(gpu)
    t = check_int("tp_size", tp_size, 1)
    check_bool("expert_parallel", expert_parallel)
    check_choice("window_cache", window_cache, WINDOW_CACHES)
    weight_format, act_bytes = _weight_format(shape, weight_format, weight_bytes)
    kv_format, kv_bytes = _kv_format(kv_format, kv_bytes)
    check_int("block_size", block_size, 1)
    check_float("gpu_memory_utilization", gpu_memory_utilization, above=0.0, maximum=1.0)
    check_int("profile_tokens", profile_tokens, 1)
    if non_torch_bytes is None:
        non_torch_bytes = outside_bytes(ring_peers(t))
    check_int("non_torch_bytes", non_torch_bytes, 0)
    _check_split(shape, t, expert_parallel)
    weights = weight_bytes * params_per_rank(shape, t, expert_parallel) if weight_format is None else \
        format_bytes(shape, weight_format, t, expert_parallel).total
    peak = profile_tokens * (3 * shape.d_model + 2 * shape.active_ffn_dim // t) * act_bytes
    budget = math.floor(gpu_memory_utilization * g.memory_bytes)
    kv_cache = max(0, budget - weights - peak - non_torch_bytes)
    if shape.kv_lora_rank:  # MLA: the compressed cache, whole on every rank
        per_block = block_size * shape.n_layer * shape.kv_cache_width(t) * kv_bytes
    else:
        per_block = block_size * kv_bytes_per_token(shape.n_layer, max(1, shape.kv_heads // t), shape.head_dim,
                                                    kv_bytes)
    windows = tuple(layer_window(shape, i) if window_cache == "per_layer" or not shape.full_attention_every
                    else None for i in range(shape.n_layer))
    return ServingEstimate(g.name, budget, weights, peak, non_torch_bytes, kv_cache, per_block, block_size,
                           shape.sliding_window, windows, weight_format, kv_format, expert_parallel, window_cache)


def _weight_format(shape, weight_format, weight_bytes) -> tuple:
    """(the format, or None when ``weight_bytes`` is given; the activations' bytes)."""
    if weight_format is not None and weight_bytes is not None:
        raise ArgumentError(f"weight_format={weight_format!r} and weight_bytes={weight_bytes!r}: give one",
                            "format_and_bytes", format_name="weight_format", format=weight_format,
                            bytes_name="weight_bytes", bytes=weight_bytes)
    if weight_bytes is not None:
        return None, check_choice("weight_bytes", weight_bytes, (1, 2, 4))
    return (default_weight_format(shape) if weight_format is None else weight_format), 2


def _kv_format(kv_format, kv_bytes) -> tuple:
    """(the KV format's name or None, its bytes an element)."""
    if kv_format is not None and kv_bytes is not None:
        raise ArgumentError(f"kv_format={kv_format!r} and kv_bytes={kv_bytes!r}: give one", "format_and_bytes",
                            format_name="kv_format", format=kv_format, bytes_name="kv_bytes", bytes=kv_bytes)
    if kv_bytes is not None:
        return None, check_choice("kv_bytes", kv_bytes, (1, 2, 4))
    kv_format = "bf16" if kv_format is None else kv_format
    return kv_format, KV_FORMATS[check_choice("kv_format", kv_format, tuple(KV_FORMATS))]


def _check_split(shape, t: int, ep: bool) -> None:
    """t divides the query heads and divides or is a multiple of the KV heads; with experts and no
    expert parallelism it divides the experts' width too, with it the number of experts."""
    kv = shape.kv_heads
    if shape.n_head % t or (kv % t and t % kv):
        raise ArgumentError(f"tp_size={t} must divide n_head={shape.n_head}, and divide or be a multiple of "
                            f"n_kv_head={kv}", "serving_tp", tp_size=t, n_head=shape.n_head, n_kv_head=kv)
    if ep and not shape.n_experts:
        raise ArgumentError("expert_parallel=True needs experts; this model is dense (n_experts=0)",
                            "expert_parallel", n_experts=0)
    if shape.n_experts and not ep and shape.expert_dim % t:
        raise ArgumentError(f"tp_size={t} must divide d_expert={shape.expert_dim} (each expert sliced by t), "
                            "or shard the experts whole (expert_parallel)", "serving_experts", tp_size=t,
                            d_expert=shape.expert_dim)
