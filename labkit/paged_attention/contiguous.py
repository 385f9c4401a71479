"""The contiguous KV cache of incremental decoding: Chapter 8's baseline before paging.

A cache is passed to ``GPT.forward(idx, kv_cache=cache)`` and implements the protocol the model
declares (:class:`labkit.model.KVCacheProtocol`):

- ``begin(idx) -> pos``: the positions (T,) or (B, T) of the T new tokens of ``idx`` (B, T),
  which the model's learned position embedding needs;
- ``attend(layer, q, k, v) -> y``: store the new keys and values of ``layer`` and attend the new
  queries over every key kept so far, causally. q, y: (B, nh, T, hs); k, v: (B, n_kv, T, hs).

:class:`KVCache` keeps one (B, n_kv, max_len, hs) slab per layer: the key-value heads only, so
grouped-query attention caches n_kv / nh of what multi-head attention does (Ainslie et al. 2023).
The paged cache (:mod:`.cache`) implements the same protocol over blocks.
"""

from __future__ import annotations

import torch

from ..attention import reference_attention
from ..model import check_gpt2_block
from ..validate import check_bool, check_int

__all__ = ["KVCache", "generate"]


class KVCache:
    """Keys and values of B sequences in contiguous (B, n_kv_head, max_len, hs) tensors per layer.

    ``n_kv_head``: the key-value heads kept (n_head for multi-head attention). Every sequence
    of the batch has the same length; ``length`` tokens are stored so far. A
    forward's tokens count only once its last layer has attended: a forward the model refuses
    part-way (a bad token id, a position past its ``seq_len``) leaves the cache as it was.
    """

    def __init__(self, n_layer, batch_size, n_kv_head, head_dim, max_len, *, device="cpu",
                 dtype=torch.float32):
        for name, value in [("n_layer", n_layer), ("batch_size", batch_size),
                            ("n_kv_head", n_kv_head), ("head_dim", head_dim), ("max_len", max_len)]:
            check_int(name, value, 1)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype: keys and values")
        shape = (batch_size, n_kv_head, max_len, head_dim)  # (B, n_kv, S, hs)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.max_len, self.length = max_len, 0
        self._new = None  # (start, end) of the forward in progress

    @classmethod
    def for_model(cls, model, batch_size, max_len=None):
        """A cache shaped for ``model`` (a labkit GPT), on its device and in its dtype."""
        cfg, p = model.cfg, next(model.parameters())
        check_gpt2_block(cfg, "KVCache", supports=("norm", "mlp", "pos", "d_ff", "tie_embeddings", "bias",
                                                   "n_positions", "n_kv_head"))
        n_kv = cfg.kv_heads // getattr(model, "tp_size", 1)  # a tensor-parallel rank: its heads only
        max_len = cfg.seq_len if max_len is None else check_int("max_len", max_len, 1)
        return cls(cfg.n_layer, batch_size, n_kv, cfg.head_dim, max_len,
                   device=p.device, dtype=p.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the cache (all layers, keys and values), used or not."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin(self, idx):
        """Positions of the new tokens; nothing is stored until every layer has attended."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if B != self.k[0].size(0):
            raise ValueError(f"idx has batch {B} but the cache holds "
                             f"batch_size={self.k[0].size(0)}")
        if self.length + T > self.max_len:
            raise ValueError(f"{self.length} cached + {T} new tokens exceed "
                             f"max_len={self.max_len}")
        self._new = (self.length, self.length + T)
        return torch.arange(self.length, self.length + T, device=idx.device)  # (T,)

    def attend(self, layer, q, k, v):
        if self._new is None:
            raise RuntimeError("attend() before begin(): call the model with kv_cache=cache")
        s, e = self._new
        B, n_kv, _, hs = self.k[layer].shape
        want = (B, n_kv, e - s, hs)
        if (not tuple(k.shape) == tuple(v.shape) == want or q.dim() != 4 or (q.size(0), q.size(2), q.size(3))
                != (B, e - s, hs) or q.size(1) % n_kv):
            raise ValueError(f"q, k, v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} must be "
                             f"(B, nh, T, hs) with n_kv_head={n_kv} dividing nh, and (B, n_kv, T, hs) = {want}: "
                             "this cache was built for another model")
        self.k[layer][:, :, s:e] = k  # (B, n_kv, T, hs) written at positions s..e-1
        self.v[layer][:, :, s:e] = v
        keys, values = self.k[layer][:, :, :e], self.v[layer][:, :, :e]  # (B, n_kv, e, hs)
        # query i sits at position s + i and sees keys 0..s+i: a decode step (T = 1) sees all
        y = reference_attention(q, keys, values, causal=True, q_offset=s, softmax_dtype=q.dtype)
        if layer == len(self.k) - 1:  # the last layer: the forward's tokens now count
            self.length, self._new = e, None
        return y  # (B, nh, T, hs)


@torch.no_grad()
def generate(model, prompt, max_new_tokens, *, use_cache=True):
    """Greedy decoding: prompt (B, T0) int64 -> (B, T0 + max_new_tokens).

    With ``use_cache`` the prompt is run once and every later step feeds one token through a
    :class:`KVCache`; without it every step recomputes the whole sequence (the reference).
    """
    check_int("max_new_tokens", max_new_tokens, 0)
    check_bool("use_cache", use_cache)
    if (not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.size(1) < 1
            or prompt.is_floating_point() or prompt.dtype == torch.bool):
        what = (f"a {prompt.dtype} tensor of shape {tuple(prompt.shape)}"
                if isinstance(prompt, torch.Tensor) else type(prompt).__name__)
        raise ValueError(f"prompt must be a (B, T0) integer tensor of token ids with T0 >= 1, got {what}")
    total = prompt.size(1) + max_new_tokens
    if total > model.cfg.seq_len:
        raise ValueError(f"prompt {prompt.size(1)} + max_new_tokens {max_new_tokens} exceed "
                         f"seq_len={model.cfg.seq_len}")
    out = prompt
    cache = KVCache.for_model(model, prompt.size(0), total) if use_cache else None
    feed = prompt
    for _ in range(max_new_tokens):
        logits = model(feed, kv_cache=cache) if use_cache else model(out)  # (B, T, V)
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
        out = torch.cat([out, token], dim=1)
        feed = token if use_cache else out
    return out
