"""KV-cache capacity of a served model, per GPU, by vLLM's rule (Kwon et al. 2023).

vLLM gives the KV cache what is left of ``gpu_memory_utilization`` x the GPU's memory after the
weights, the peak of a forward and the memory PyTorch does not manage. It measures the last two
by profiling; this estimate assumes them (see :func:`serving_memory`). Bytes per token come from
``labkit.paged_attention.analytic.kv_bytes_per_token`` (2 L n_kv head_dim e: grouped-query
attention counted; under MLA L (kv_lora_rank + qk_rope_head_dim) e, ``ModelShape.kv_cache_width``);
a sliding window caps the tokens one sequence caches. Every expert's weights count. Windows that
differ by layer (Gemma 2, gpt-oss, Llama 4) are refused by name until they are modelled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..hardware import get_gpu
from ..memory.runtime import CONTEXT_BYTES, ring_peers
from ..memory.runtime import non_torch_bytes as outside_bytes
from ..paged_attention.analytic import blocks_for_tokens, cached_tokens, kv_bytes_per_token
from ..validate import ArgumentError, check_choice, check_float, check_int
from .report import breakdown
from .training import as_shape

__all__ = ["ServingEstimate", "serving_memory", "check_context_len", "NON_TORCH_BYTES", "PROFILE_TOKENS"]

NON_TORCH_BYTES = CONTEXT_BYTES  # one GPU's memory outside PyTorch: labkit.memory.runtime (vLLM measures it)
PROFILE_TOKENS = 8192  # tokens of vLLM's profiling forward: its max_num_batched_tokens, assumed 8192


@dataclass(frozen=True)
class ServingEstimate:
    """Per GPU: the budget (utilisation x memory), weights, forward peak, non-PyTorch memory, the
    KV cache's bytes, its ``num_blocks`` of ``block_size`` tokens and ``max_tokens``."""

    gpu: str
    budget: int
    weights: int
    activation_peak: int
    non_torch: int
    kv_cache: int
    bytes_per_block: int
    block_size: int
    sliding_window: int | None = None

    @property
    def num_blocks(self) -> int:
        return self.kv_cache // self.bytes_per_block

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, context_len: int) -> int:
        """Sequences of ``context_len`` tokens whose caches fit at once (whole blocks each; with a
        sliding window, only the window's tokens are cached)."""
        cached = cached_tokens(self, context_len)
        return self.num_blocks // blocks_for_tokens(cached, self.block_size)

    def to_dict(self) -> dict:
        return {**asdict(self), "num_blocks": self.num_blocks, "max_tokens": self.max_tokens}

    def __str__(self) -> str:
        parts = {"weights": self.weights, "forward peak": self.activation_peak,
                 "non-PyTorch": self.non_torch, "KV cache": self.kv_cache}
        return breakdown(f"Serving memory per GPU on {self.gpu} (GB = 10^9 bytes)", parts, self.budget,
                         (f"{self.num_blocks} blocks of {self.block_size} tokens = {self.max_tokens} tokens",))


def check_context_len(shape, context_len: int) -> None:
    """Refuse a request longer than the model reads: ``context_len`` tokens in 1..``shape.seq_len``
    (its ``max_position_embeddings``)."""
    check_int("context_len", context_len, 1)
    shape = as_shape(shape)
    if context_len > shape.seq_len:
        raise ArgumentError(f"context_len={context_len} must be at most the model's seq_len={shape.seq_len}",
                            "context_len", context_len=context_len, seq_len=shape.seq_len)


def serving_memory(shape, *, gpu, tp_size: int = 1, weight_bytes: int = 2, kv_bytes: int = 2,
                   block_size: int = 16, gpu_memory_utilization: float = 0.9,
                   profile_tokens: int = PROFILE_TOKENS, non_torch_bytes: int | None = None) -> ServingEstimate:
    """The KV cache one GPU of ``tp_size`` holds, by vLLM's rule.

    budget = ``gpu_memory_utilization`` x memory; KV cache = budget - weights (this rank's
    parameters x ``weight_bytes``) - forward peak - ``non_torch_bytes`` (None: the CUDA context and,
    over t > 1 ranks, NCCL's buffers for the tensor-parallel ring, ``labkit.memory.runtime``). The forward peak is
    assumed, not profiled: vLLM's profiling batch of ``profile_tokens`` tokens runs without
    autograd and with a FlashAttention-style kernel (no s^2 scores), so at most one layer's tensors
    live at once: the residual stream, the norm's output and the attention output (3h a token,
    whole on every rank) and the MLP's gate and up outputs (2 d_ff/t; with experts, the k chosen and
    the shared ones: ``ModelShape.active_ffn_dim``), in ``weight_bytes``; the
    logits of one token a sequence are left out. When t exceeds the KV heads, each rank keeps one
    KV head (vLLM replicates them).
    """
    shape = as_shape(shape)
    g = get_gpu(gpu)
    t = check_int("tp_size", tp_size, 1)
    check_choice("weight_bytes", weight_bytes, (1, 2, 4))
    check_choice("kv_bytes", kv_bytes, (1, 2, 4))
    check_int("block_size", block_size, 1)
    check_float("gpu_memory_utilization", gpu_memory_utilization, above=0.0, maximum=1.0)
    check_int("profile_tokens", profile_tokens, 1)
    if non_torch_bytes is None:
        non_torch_bytes = outside_bytes(ring_peers(t))
    check_int("non_torch_bytes", non_torch_bytes, 0)
    kv = shape.kv_heads
    unmodelled = [f for f in shape.features() if f in ("per-layer windows", "chunked attention")]
    if unmodelled:
        raise ArgumentError(f"{unmodelled}: the serving estimate caps every layer's cache at one window; "
                            "windows that differ by layer are not modelled yet", "windows", unmodelled=unmodelled)
    if shape.n_head % t or (kv % t and t % kv):
        raise ArgumentError(f"tp_size={t} must divide n_head={shape.n_head}, and divide or be a multiple of "
                            f"n_kv_head={kv}", "serving_tp", tp_size=t, n_head=shape.n_head, n_kv_head=kv)
    weights = _weights_per_rank(shape, t) * weight_bytes
    peak = profile_tokens * (3 * shape.d_model + 2 * shape.active_ffn_dim // t) * weight_bytes
    budget = math.floor(gpu_memory_utilization * g.memory_bytes)
    kv_cache = max(0, budget - weights - peak - non_torch_bytes)
    if shape.kv_lora_rank:  # MLA: the compressed cache, whole on every rank
        per_block = block_size * shape.n_layer * shape.kv_cache_width(t) * kv_bytes
    else:
        per_block = block_size * kv_bytes_per_token(shape.n_layer, max(1, kv // t), shape.head_dim, kv_bytes)
    return ServingEstimate(g.name, budget, weights, peak, non_torch_bytes, kv_cache, per_block, block_size,
                           shape.sliding_window)


def _weights_per_rank(shape, t: int) -> int:
    """Parameters on one of t ranks: the tensor-parallel split when t divides every dimension,
    else (KV heads replicated) Ψ/t rounded up, an estimate."""
    if shape.tp_divides(t):
        return shape.stage_params(t)
    return -(-shape.num_params() // t)
