"""Standard attention, the baseline FlashAttention replaces, and the checks both share (Chapter 7).

``standard_attention`` materialises the (s_q, s_k) scores as FlashAttention's Algorithm 0 does
(Dao et al. 2022): S = Q Kᵀ / sqrt(d), P = softmax(S), O = P V, differentiated by autograd.
Causal masks are bottom-right aligned (FlashAttention-2 >= 2.1): query i sees key j when
j <= i + s_k - s_q, so with s_q = s_k it is the usual lower triangle; s_q > s_k is refused,
because the first s_q - s_k queries would then see no key at all. Keys and values may have
fewer heads than the queries (grouped-query attention, Ainslie et al. 2023): q (..., h, s_q, d),
k and v (..., h_kv, s_k, d) with h_kv dividing h; query head i reads kv head i // (h / h_kv).
"""

from __future__ import annotations

import torch

from .. import attention
from ..validate import check_bool, check_int

__all__ = ["check_inputs", "causal_mask", "standard_attention"]


def check_inputs(q, k, v, causal) -> None:
    """Raise ValueError/TypeError naming the argument when q, k, v cannot be attended."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name}.dtype={t.dtype} must be a floating dtype "
                             "(float16, bfloat16, float32 or float64)")
        if t.dim() < 2:
            raise ValueError(f"{name}.shape={tuple(t.shape)} must be (..., seq_len, head_dim)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must be the same")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices {q.device}, {k.device}, {v.device} must be the same")
    if k.shape != v.shape:
        raise ValueError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} must be equal")
    if q.dim() != k.dim() or q.shape[:-3] != k.shape[:-3]:
        raise ValueError(f"q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)} must have the "
                         "same leading (batch) dimensions")
    if q.dim() >= 3 and q.shape[-3] % k.shape[-3]:
        raise ValueError(f"k has h_kv={k.shape[-3]} heads, which must divide q's h={q.shape[-3]} heads "
                         "(grouped-query attention: each kv head serves h / h_kv query heads)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has d={q.shape[-1]}, k and v have d={k.shape[-1]}")
    if q.shape[-1] == 0 or q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}: "
                         "seq_len and head_dim must be positive")
    check_bool("causal", causal)
    if causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(f"causal=True with s_q={q.shape[-2]} > s_k={k.shape[-2]}: the causal mask is "
                         "bottom-right aligned (query i sees keys j <= i + s_k - s_q), so the first "
                         f"{q.shape[-2] - k.shape[-2]} queries would see no key; use s_q <= s_k")


def causal_mask(s_q: int, s_k: int, device=None) -> torch.Tensor:
    """(s_q, s_k) bool, True where query i may NOT see key j: j > i + s_k - s_q (bottom-right)."""
    check_int("s_q", s_q, minimum=1)
    check_int("s_k", s_k, minimum=1)
    if s_q > s_k:
        raise ValueError(f"s_q={s_q} > s_k={s_k}: bottom-right aligned, the first {s_q - s_k} "
                         "queries would see no key (their softmax would be nan); use s_q <= s_k")
    return ~attention.causal_mask(s_q, s_k, device=device)  # the core's rule, negated: hidden keys


def standard_attention(q, k, v, causal: bool = False, *, return_lse: bool = False):
    """softmax(q kᵀ / sqrt(d)) v with the full score matrix materialised; autograd differentiates it.

    q (..., s_q, d), k and v (..., s_k, d) -> (..., s_q, d); with ``return_lse`` also the row
    log-sum-exp L (..., s_q) of the scaled scores. Computes in the inputs' dtype (fp64 for a reference).
    """
    check_inputs(q, k, v, causal)
    check_bool("return_lse", return_lse)
    # labkit.attention's reference, its softmax kept in the inputs' dtype: the plain PyTorch
    # attention a low-precision kernel is compared with
    return attention.reference_attention(q, k, v, causal=causal, return_lse=return_lse, softmax_dtype=q.dtype)
