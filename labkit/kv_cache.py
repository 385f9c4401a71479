"""The KV cache of incremental decoding (Chapter 8): keys and values kept so a step feeds one token.

A cache is passed to ``GPT.forward(idx, kv_cache=cache)``. It must provide two methods, the
whole protocol the model relies on:

- ``begin(idx) -> pos``: make room for the T new tokens of ``idx`` (B, T) and return their
  positions (T,) or (B, T), which the model's learned position embedding needs;
- ``attend(layer, q, k, v) -> y``: store the new keys and values of ``layer`` and attend the new
  queries over every key kept so far, causally. q, k, v, y: (B, nh, T, hs).

:class:`KVCache` is the contiguous cache, one (B, nh, max_len, hs) slab per layer; Chapter 8's
paged cache (``labkit.paged_attention``) implements the same protocol over blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["KVCache", "generate"]


class KVCache:
    """Keys and values of a batch of B sequences in contiguous (B, nh, max_len, hs) tensors per layer.

    Every sequence of the batch has the same length; ``length`` tokens are stored so far.
    """

    def __init__(self, n_layer, batch_size, n_head, head_dim, max_len, *, device="cpu", dtype=torch.float32):
        for name, value in [("n_layer", n_layer), ("batch_size", batch_size), ("n_head", n_head),
                            ("head_dim", head_dim), ("max_len", max_len)]:
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        shape = (batch_size, n_head, max_len, head_dim)  # (B, nh, S, hs)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.max_len, self.length, self.start = max_len, 0, 0

    @classmethod
    def for_model(cls, model, batch_size, max_len=None):
        """A cache shaped for ``model`` (a labkit GPT), on its device and in its dtype."""
        cfg, p = model.cfg, next(model.parameters())
        n_head = cfg.n_head // getattr(model, "tp_size", 1)  # a tensor-parallel rank: its heads only
        return cls(cfg.n_layer, batch_size, n_head, cfg.head_dim, max_len or cfg.seq_len,
                   device=p.device, dtype=p.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the cache (all layers, keys and values), used or not."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin(self, idx):
        B, T = idx.shape
        if B != self.k[0].size(0):
            raise ValueError(f"idx has batch {B} but the cache holds batch_size={self.k[0].size(0)}")
        if self.length + T > self.max_len:
            raise ValueError(f"{self.length} cached + {T} new tokens exceed max_len={self.max_len}")
        self.start, self.length = self.length, self.length + T
        return torch.arange(self.start, self.length, device=idx.device)  # (T,)

    def attend(self, layer, q, k, v):
        s, e = self.start, self.length
        self.k[layer][:, :, s:e] = k  # (B, nh, T, hs) written at positions s..e-1
        self.v[layer][:, :, s:e] = v
        keys, values = self.k[layer][:, :, :e], self.v[layer][:, :, :e]  # (B, nh, e, hs)
        att = (q @ keys.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, T, e)
        # query i sits at position s + i and sees keys 0..s+i: a decode step (T = 1) sees all
        future = torch.arange(e, device=q.device)[None, :] > torch.arange(s, e, device=q.device)[:, None]
        att = F.softmax(att.masked_fill(future, float("-inf")), dim=-1)
        return att @ values  # (B, nh, T, hs)


@torch.no_grad()
def generate(model, prompt, max_new_tokens, *, use_cache=True):
    """Greedy decoding: prompt (B, T0) int64 -> (B, T0 + max_new_tokens).

    With ``use_cache`` the prompt is run once and every later step feeds one token through a
    :class:`KVCache`; without it every step recomputes the whole sequence (the reference).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative int")
    total = prompt.size(1) + max_new_tokens
    if total > model.cfg.seq_len:
        raise ValueError(f"prompt {prompt.size(1)} + max_new_tokens {max_new_tokens} exceed seq_len={model.cfg.seq_len}")
    out = prompt
    cache = KVCache.for_model(model, prompt.size(0), total) if use_cache else None
    feed = prompt
    for _ in range(max_new_tokens):
        logits = model(feed, kv_cache=cache) if use_cache else model(out)  # (B, T, V)
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
        out = torch.cat([out, token], dim=1)
        feed = token if use_cache else out
    return out
