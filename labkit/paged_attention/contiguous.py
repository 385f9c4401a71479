"""The contiguous KV cache of incremental decoding: Chapter 8's baseline before paging.

A cache is passed to ``GPT.forward(idx, kv_cache=cache)`` and implements the protocol the model
declares (:class:`labkit.model.KVCacheProtocol`):

- ``begin(idx) -> pos``: the positions (T,) or (B, T) of the T new tokens of ``idx`` (B, T),
  which the model's learned position embedding needs;
- ``attend(layer, q, k, v) -> y``: store the new keys and values of ``layer`` and attend the new
  queries over every key kept so far, causally. q, y: (B, nh, T, hs); k, v: (B, n_kv, T, hs).

:class:`KVCache` keeps one (B, n_kv, max_len, hs) slab per layer: the key-value heads only, so
grouped-query attention caches n_kv / nh of what multi-head attention does (Ainslie et al. 2023).
With ``latent=True`` (an MLA model, :mod:`labkit.mla`) it keeps one (B, 1, max_len, c + d_rope)
slab per layer, the latent and the rotary key of each token, and no values; ``attend_latent``
stores them and hands every kept row to the model's attention. The paged cache (:mod:`.cache`)
implements the same protocol over blocks.
"""

from __future__ import annotations

import torch

from ..attention import reference_attention
from ..model import check_gpt2_block
from ..validate import check_bool, check_int

__all__ = ["KVCache", "generate", "check_latent", "check_kind", "latent_width"]

_SUPPORTS = ("norm", "mlp", "pos", "d_ff", "tie_embeddings", "bias", "n_positions", "n_kv_head",
             "kv_lora_rank")  # what the caches have been checked on (tests/test_kv_cache.py, test_mla.py)


def latent_width(cfg, technique: str) -> tuple[int, int] | None:
    """(1, kv_lora_rank + qk_rope_head_dim), the one row a token keeps a layer, for an MLA config;
    None for one with keys and values. Refuses what ``technique`` has not been checked on."""
    check_gpt2_block(cfg, technique, supports=_SUPPORTS)
    return (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim) if cfg.kv_lora_rank else None


def check_latent(latent, absorb, n_kv_head) -> None:
    """A latent cache keeps one row a token (n_kv_head=1); ``absorb`` reads it, so it needs one."""
    check_bool("latent", latent)
    check_bool("absorb", absorb)
    if latent and n_kv_head != 1:
        raise ValueError(f"latent=True keeps one row of head_dim = kv_lora_rank + qk_rope_head_dim a token: "
                         f"n_kv_head must be 1, not {n_kv_head}")
    if absorb and not latent:
        raise ValueError("absorb=True folds MLA's W^UK and W^UV into decoding: it needs latent=True")


def check_kind(latent: bool, call_latent: bool) -> None:
    """A cache of MLA latents serves ``attend_latent`` only, one of keys and values ``attend`` only."""
    if latent != call_latent:
        raise ValueError(f"this cache holds {'MLA latents' if latent else 'keys and values'} "
                         f"(latent={latent}): it was built for another model")


class KVCache:
    """Keys and values of B sequences in contiguous (B, n_kv_head, max_len, hs) tensors per layer.

    ``n_kv_head``: the key-value heads kept (n_head for multi-head attention). Every sequence
    of the batch has the same length; ``length`` tokens are stored so far. A
    forward's tokens count only once its last layer has attended: a forward the model refuses
    part-way (a bad token id, a position past its ``seq_len``) leaves the cache as it was.
    ``latent``: rows of an MLA model in ``k`` (n_kv_head=1, head_dim=c + d_rope), ``v`` empty;
    ``absorb``: decode with W^UK and W^UV absorbed (:meth:`labkit.mla.MultiHeadLatentAttention.attend_latent`).
    """

    def __init__(self, n_layer, batch_size, n_kv_head, head_dim, max_len, *, device="cpu",
                 dtype=torch.float32, latent=False, absorb=False):
        for name, value in [("n_layer", n_layer), ("batch_size", batch_size),
                            ("n_kv_head", n_kv_head), ("head_dim", head_dim), ("max_len", max_len)]:
            check_int(name, value, 1)
        check_latent(latent, absorb, n_kv_head)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype: keys and values")
        shape = (batch_size, n_kv_head, max_len, head_dim)  # (B, n_kv, S, hs)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [] if latent else [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.max_len, self.length, self.latent, self.absorb = max_len, 0, latent, absorb
        self._new = None  # (start, end) of the forward in progress

    @classmethod
    def for_model(cls, model, batch_size, max_len=None, *, absorb=False):
        """A cache shaped for ``model`` (a labkit GPT), on its device and in its dtype."""
        cfg, p = model.cfg, next(model.parameters())
        latent = latent_width(cfg, "KVCache")
        n_kv = cfg.kv_heads // getattr(model, "tp_size", 1)  # a tensor-parallel rank: its heads only
        n_kv, head_dim = latent or (n_kv, cfg.head_dim)
        max_len = cfg.seq_len if max_len is None else check_int("max_len", max_len, 1)
        return cls(cfg.n_layer, batch_size, n_kv, head_dim, max_len,
                   device=p.device, dtype=p.dtype, latent=latent is not None, absorb=absorb)

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

    def _step(self, layer, latent: bool) -> tuple[int, int]:
        """(start, end) of the forward in progress; refuses a call this cache cannot serve."""
        if self._new is None:
            raise RuntimeError("attend() before begin(): call the model with kv_cache=cache")
        check_kind(self.latent, latent)
        return self._new

    def attend_latent(self, layer, c_kv, k_rope, attend):
        """MLA: store [c_kv; k_rope] (B, T, c + d_rope), attend over every row kept (KVCacheProtocol)."""
        s, e = self._step(layer, True)
        row = torch.cat([c_kv, k_rope], dim=-1)  # (B, T, c + d_rope)
        rows = self.k[layer][:, 0]  # (B, max_len, c + d_rope), a view
        if tuple(row.shape) != (rows.size(0), e - s, rows.size(2)):
            raise ValueError(f"c_kv {tuple(c_kv.shape)} and k_rope {tuple(k_rope.shape)} must make rows "
                             f"(B, T, c + d_rope) = {(rows.size(0), e - s, rows.size(2))}")
        rows[:, s:e] = row
        y = attend(rows[:, :e], s, self.absorb)  # query i at position s + i sees rows 0..s+i
        if layer == len(self.k) - 1:  # the last layer: the forward's tokens now count
            self.length, self._new = e, None
        return y  # (B, nh, T, d_v)

    def attend(self, layer, q, k, v):
        s, e = self._step(layer, False)
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
def generate(model, prompt, max_new_tokens, *, use_cache=True, absorb=False):
    """Greedy decoding: prompt (B, T0) int64 -> (B, T0 + max_new_tokens).

    With ``use_cache`` the prompt is run once and every later step feeds one token through a
    :class:`KVCache` (``absorb``: MLA's absorbed decoding); without it every step recomputes
    the whole sequence (the reference).
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
    cache = KVCache.for_model(model, prompt.size(0), total, absorb=absorb) if use_cache else None
    feed = prompt
    for _ in range(max_new_tokens):
        logits = model(feed, kv_cache=cache) if use_cache else model(out)  # (B, T, V)
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
        out = torch.cat([out, token], dim=1)
        feed = token if use_cache else out
    return out
