"""Attention in one place: the causal mask, reference attention, and the log-sum-exp merge.

Every attention in labkit is softmax(q kᵀ · scale) v over some keys: the model's core, a KV
cache's decode step, PagedAttention's gathered blocks, FlashAttention's baseline, a ring of
context-parallel shards. What they share lives here, written once:

- :func:`causal_mask`: which key a query may see, with both given *global* positions, so a
  shard of queries or keys can be placed anywhere in the sequence;
- :func:`reference_attention`: the materialised (s_q, s_k) scores, grouped-query attention
  (Ainslie et al. 2023), optionally the row log-sum-exp L (Chapter 7, eq-fa-lse);
- :func:`merge_attention`: two partial results over disjoint keys merged into the result over
  their union, Chapter 7's eq-fa-merge written with L = m + log ℓ.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .validate import ArgumentError, check_bool, check_float, check_int

__all__ = ["causal_mask", "reference_attention", "merge_attention"]


def _check_offset(name: str, value) -> None:
    """An offset is an int >= 0, or an integer tensor of offsets (one per sequence)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ArgumentError(f"{name}.dtype={value.dtype} must be an integer dtype (int64)")
    else:
        check_int(name, value, 0)


def causal_mask(s_q: int, s_k: int, *, q_offset=None, k_offset: int = 0, sliding_window: int | None = None,
                device=None) -> torch.Tensor:
    """(s_q, s_k) bool, True where query i may attend key j: k_offset + j <= q_offset + i.

    Query i and key j sit at global positions q_offset + i and k_offset + j. By default
    q_offset = k_offset + s_k - s_q: the queries are the *last* s_q positions of the keys
    (bottom-right alignment, as a KV cache decodes and FlashAttention-2 >= 2.1 masks), so with
    s_q = s_k it is the usual lower triangle. A query before every key sees none: its row is
    all False. ``sliding_window`` w also hides keys w or more positions back (Mistral).
    A tensor ``q_offset`` (...,) of per-sequence offsets gives a (..., s_q, s_k) mask.
    """
    check_int("s_q", s_q, 1)
    check_int("s_k", s_k, 1)
    _check_offset("k_offset", k_offset)
    if q_offset is None:
        q_offset = k_offset + s_k - s_q  # may be < 0: the first queries then see no key
    else:
        _check_offset("q_offset", q_offset)
    if sliding_window is not None:
        check_int("sliding_window", sliding_window, 1)
    if isinstance(q_offset, torch.Tensor):
        device = q_offset.device if device is None else device
        q_offset = q_offset.to(device)[..., None, None]  # (..., 1, 1)
    q_pos = q_offset + torch.arange(s_q, device=device)[:, None]  # (s_q, 1) or (..., s_q, 1)
    k_pos = k_offset + torch.arange(s_k, device=device)[None, :]  # (1, s_k)
    visible = k_pos <= q_pos  # (..., s_q, s_k)
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


def _may_leave_rows_empty(s_q, s_k, q_offset, k_offset, sliding_window) -> bool:
    """Whether some query of a causal mask may see no key (decided on the host, without a sync)."""
    if isinstance(q_offset, torch.Tensor):
        return True
    if q_offset is None:
        q_offset = k_offset + s_k - s_q
    last_q, last_k = q_offset + s_q - 1, k_offset + s_k - 1
    return q_offset < k_offset or (sliding_window is not None and last_q - sliding_window >= last_k)


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ArgumentError(f"{name}.dtype={t.dtype} must be a floating dtype")
        if t.dim() < 2 or 0 in t.shape:
            raise ArgumentError(f"{name}.shape={tuple(t.shape)} must be (..., heads, seq_len, head_dim), non-empty")
    if not q.dtype == k.dtype == v.dtype:
        raise ArgumentError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must be the same")
    if k.shape[:-1] != v.shape[:-1]:  # a value head may differ in size from a key head (MLA)
        raise ArgumentError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} must be equal but for "
                            "the head size")
    if q.dim() != k.dim() or q.shape[:-3] != k.shape[:-3] or q.shape[-1] != k.shape[-1]:
        raise ArgumentError(f"q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)} must be (..., h, s_q, d) "
                         "and (..., h_kv, s_k, d) with the same leading dimensions and head_dim d")
    if q.dim() >= 3 and q.shape[-3] % k.shape[-3]:
        raise ArgumentError(f"k has h_kv={k.shape[-3]} heads, which must divide q's h={q.shape[-3]} heads "
                         "(grouped-query attention: each kv head serves h / h_kv query heads)")


def reference_attention(q, k, v, *, causal: bool = False, q_offset=None, k_offset: int = 0, scale=None,
                        return_lse: bool = False, mask=None, sliding_window: int | None = None,
                        dropout_p: float = 0.0, softmax_dtype=None):
    """softmax(q kᵀ · scale + mask) v with the (s_q, s_k) scores materialised; autograd differentiates it.

    q (..., h, s_q, d); k (..., h_kv, s_k, d), v (..., h_kv, s_k, d_v), h_kv dividing h: query
    head i reads kv head i // (h / h_kv). ``causal``: :func:`causal_mask` with its offsets (and ``sliding_window``);
    ``mask``: a bool (..., s_q, s_k) of visible keys, broadcast over heads (ANDed with causal).
    scale: 1/sqrt(d) by default. The softmax runs in ``softmax_dtype`` (default float32, float64
    for float64 input). Returns out (..., h, s_q, d_v) in q's dtype, with ``return_lse`` also
    L (..., h, s_q) in the softmax dtype. A row the causal mask leaves without a key gives out 0
    and L = -inf (a ``mask`` alone must leave every row a key: its rows are not checked).
    """
    _check_qkv(q, k, v)
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_float("scale", scale)
    check_float("dropout_p", dropout_p, 0.0, below=1.0)
    if softmax_dtype is None:
        softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    elif not (isinstance(softmax_dtype, torch.dtype) and softmax_dtype.is_floating_point):
        raise ArgumentError(f"softmax_dtype={softmax_dtype!r} must be None or a floating torch.dtype")
    s_q, s_k = q.shape[-2], k.shape[-2]
    group = q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1
    if group > 1:  # (..., h_kv, g, s, d) against (..., h_kv, 1, s_k, d): no copy of k and v
        q = q.unflatten(-3, (k.shape[-3], group))
        k, v = k.unsqueeze(-3), v.unsqueeze(-3)
    heads = 2 if group > 1 else 1  # head dimensions the mask broadcasts over
    visible, empty_rows = mask, False
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
        raise ArgumentError(f"mask must be a bool tensor (True where a key is visible), "
                            f"got {type(mask).__name__} {getattr(mask, 'dtype', '')}")
    if causal:
        cm = causal_mask(s_q, s_k, q_offset=q_offset, k_offset=k_offset, sliding_window=sliding_window,
                         device=q.device)  # (s_q, s_k) or (B, s_q, s_k)
        empty_rows = _may_leave_rows_empty(s_q, s_k, q_offset, k_offset, sliding_window)
        visible = cm if visible is None else visible & cm
    if visible is not None and visible.dim() > 2:
        visible = visible.reshape(visible.shape[:-2] + (1,) * heads + visible.shape[-2:])
    s = (q @ k.transpose(-2, -1)) * scale  # (..., h, s_q, s_k)
    if visible is not None:
        s = torch.where(visible, s, float("-inf"))
    if softmax_dtype != s.dtype:
        s = s.to(softmax_dtype)
    lse = torch.logsumexp(s, dim=-1) if return_lse else None  # -inf where a row sees nothing
    p = F.softmax(s, dim=-1)  # a row that sees nothing is nan here, zeroed below
    del s  # backward keeps p, not the scores: free them now, as an inline softmax would
    if empty_rows:
        p = torch.where(visible.any(-1, keepdim=True), p, 0.0)
    if dropout_p > 0:
        p = F.dropout(p, p=dropout_p, training=True)
    out = p.to(v.dtype) @ v  # (..., h, s_q, d)
    if group > 1:
        out = out.flatten(-4, -3)
    if not return_lse:
        return out
    return out, (lse.flatten(-3, -2) if group > 1 else lse)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """The attention over keys A ∪ B from the results over disjoint A and B (Chapter 7, eq-fa-merge).

    With L = m + log ℓ (eq-fa-lse): L = log(e^L_a + e^L_b), out = e^(L_a - L) out_a + e^(L_b - L) out_b,
    each weight at most 1. out_* (..., s, d), lse_* (..., s). Safe where either L is -inf (a part
    that saw no key); where both are, out is 0 and L is -inf. Returns (out in out_a's dtype, lse).
    """
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ArgumentError(f"{name} must be a floating torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ArgumentError(f"out_a {tuple(out_a.shape)}, out_b {tuple(out_b.shape)} must be (..., s, d) and "
                         f"lse_a {tuple(lse_a.shape)}, lse_b {tuple(lse_b.shape)} must be their (..., s)")
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, 0.0)  # the common reference (eq-fa-merge's m), 0 for empty rows
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # ℓ-like weights e^(L - m) <= 1
    total = w_a + w_b
    nonempty = total > 0
    total = torch.where(nonempty, total, 1.0)  # no 0/0, no log 0 (nor their gradients)
    lse = torch.where(nonempty, m + torch.log(total), float("-inf"))
    dtype = torch.promote_types(out_a.dtype, lse.dtype)
    out = ((w_a / total)[..., None] * out_a.to(dtype) + (w_b / total)[..., None] * out_b.to(dtype))
    return out.to(out_a.dtype), lse
