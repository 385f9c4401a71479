"""Plan serving: for each tensor-parallel degree (and, for a mixture of experts, with and without
expert parallelism), the KV blocks a GPU holds, the requests of a context length that fit at once,
and what bounds them.

Per GPU, ``labkit.estimate.serving_memory`` (vLLM's rule: the memory it may use, less the
weights' shard, less a forward's peak and what is not PyTorch's, in blocks of ``block_size``
tokens). num_gpus / t replicas serve side by side; a replica's concurrency is its blocks over
the blocks one request of ``context_len`` tokens needs, capped at ``max_num_seqs`` (vLLM's
default: 256). Bound: "weights" (no block left), "kv_cache" or "max_num_seqs".

Expert parallelism (vLLM's ``--enable-expert-parallel``) shards a replica's experts whole over its
t ranks, E/t a rank (t must divide E), where tensor parallelism slices each expert's matrices by t;
attention, dense and shared MLPs stay sliced by t. The bytes are the same when t divides both;
expert parallelism needs no split of an expert's width, and its all-to-all replaces the experts'
all-reduce (:func:`labkit.estimate.formats.params_per_rank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..estimate import as_shape, check_context_len, serving_memory
from ..hardware import get_gpu
from ..messages import current, serving_reason
from ..validate import ArgumentError, check_bool, check_float, check_int
from .sweep import _divisors

__all__ = ["ServingPlan", "ServingPlans", "plan_serving"]


@dataclass(frozen=True)
class ServingPlan:
    """One tensor-parallel degree: per-GPU blocks and tokens, per-replica and total concurrency."""

    tp_size: int
    replicas: int
    num_blocks: int
    max_tokens: int
    max_concurrency: int
    total_concurrency: int
    bound: str
    estimate: object
    # what the plan was asked for (labkit.plan.export.to_vllm writes them as vLLM's options)
    context_len: int | None = None
    weight_bytes: int | None = None
    kv_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    expert_parallel: bool = False
    weight_format: str | None = None  # the format the estimate used (None: weight_bytes a parameter)
    kv_format: str | None = None
    checkpoint_format: str | None = None  # the config's quantization_config (what vLLM reads by itself)

    def to_dict(self) -> dict:
        return {"tp_size": self.tp_size, "replicas": self.replicas, "num_blocks": self.num_blocks,
                "max_tokens": self.max_tokens, "max_concurrency": self.max_concurrency,
                "total_concurrency": self.total_concurrency, "bound": self.bound,
                "expert_parallel": self.expert_parallel, "weight_format": self.weight_format,
                "kv_format": self.kv_format, "estimate": self.estimate.to_dict()}


class ServingPlans(NamedTuple):
    """``plans``: degrees that hold at least one request, most requests first; ``refused``: the
    others (bound "weights", or too few blocks for one request)."""

    plans: list
    refused: list
    context_len: int

    def to_dict(self) -> dict:
        return {"plans": [p.to_dict() for p in self.plans], "refused": [p.to_dict() for p in self.refused],
                "context_len": self.context_len}

    def reason(self) -> str:
        """Why each refused degree serves nothing (``labkit.messages.serving_reason``, in the
        language labkit prints in)."""
        return serving_reason(self.refused, current())


def plan_serving(shape, *, gpu, num_gpus: int = 1, context_len: int, weight_bytes: int | None = None,
                 kv_bytes: int | None = None, weight_format: str | None = None, kv_format: str | None = None,
                 expert_parallel: tuple = (False, True), window_cache: str = "per_layer", block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256) -> ServingPlans:
    """Each t dividing num_gpus and the heads (and, without expert parallelism, the experts' width;
    with it, their number), each of ``expert_parallel`` (only False for a dense model): blocks,
    tokens and concurrency of requests of ``context_len`` tokens (at most the model's
    ``seq_len``); formats and ``window_cache`` as for ``serving_memory``."""
    g, shape = get_gpu(gpu), as_shape(shape)
    for name, value in (("num_gpus", num_gpus), ("context_len", context_len), ("block_size", block_size),
                        ("max_num_seqs", max_num_seqs)):
        check_int(name, value, 1)
    check_float("gpu_memory_utilization", gpu_memory_utilization, maximum=1.0, above=0.0)
    check_context_len(shape, context_len)
    if not isinstance(expert_parallel, tuple) or not expert_parallel:
        raise ArgumentError(f"expert_parallel={expert_parallel!r} must be a non-empty tuple of bools, e.g. "
                            "(False, True)", "expert_parallel")
    for ep in expert_parallel:
        check_bool("expert_parallel", ep)
    plans, refused = [], []
    for t, ep in ((t, ep) for t in _divisors(num_gpus) for ep in expert_parallel):
        if not _splits(shape, t, ep):
            continue
        est = serving_memory(shape, gpu=g, tp_size=t, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                             weight_format=weight_format, kv_format=kv_format, expert_parallel=ep,
                             window_cache=window_cache, block_size=block_size,
                             gpu_memory_utilization=gpu_memory_utilization)
        per = est.max_concurrency(context_len) if est.num_blocks else 0
        bound = "weights" if est.num_blocks == 0 else ("max_num_seqs" if per > max_num_seqs else "kv_cache")
        per = min(per, max_num_seqs)
        plan = ServingPlan(t, num_gpus // t, est.num_blocks, est.max_tokens, per, per * (num_gpus // t), bound, est,
                           context_len, weight_bytes, kv_bytes, gpu_memory_utilization, max_num_seqs, ep,
                           est.weight_format, est.kv_format, shape.weight_format)
        (plans if per else refused).append(plan)
    plans.sort(key=lambda p: (-p.total_concurrency, p.tp_size, p.expert_parallel))
    return ServingPlans(plans, refused, context_len)


def _splits(shape, t: int, ep: bool) -> bool:
    """Whether t splits the heads evenly, and the experts: sliced (t divides their width) or,
    under expert parallelism, whole (t divides their number); ep only for a mixture of experts
    over more than one rank."""
    if shape.n_head % t or shape.kv_heads % t or (ep and (not shape.n_experts or t == 1)):
        return False
    if not shape.n_experts:
        return True
    return shape.n_experts % t == 0 if ep else shape.expert_dim % t == 0
