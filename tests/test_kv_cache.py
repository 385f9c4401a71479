"""labkit.paged_attention.contiguous: incremental decoding through GPT.forward against recomputing the whole sequence."""

from __future__ import annotations

import re

import pytest
import torch

from labkit.paged_attention.contiguous import KVCache, generate
from labkit.model import GPTConfig, build_model
from labkit.paged_attention import kv_bytes_per_token_of

CFG = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=48, vocab_size=64)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return build_model(CFG, dtype=dtype).eval()


def test_greedy_with_cache_equals_recomputing_every_step():
    model = _model()
    prompt = torch.randint(0, CFG.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    with_cache = generate(model, prompt, 30)
    assert torch.equal(with_cache, generate(model, prompt, 30, use_cache=False))
    assert with_cache.shape == (3, 37)


@pytest.mark.roundoff
def test_cached_logits_match_the_full_forward_chunk_by_chunk():
    model = _model(torch.float64)
    idx = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)  # (B, T, V), the AttentionCore path
        cache = KVCache.for_model(model, 2)
        pieces = [model(idx[:, a:b], kv_cache=cache) for a, b in [(0, 9), (9, 10), (10, 16), (16, 20)]]
    # fp64: only the summation order of the attention differs between the two paths
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.length == 20


def test_the_forward_without_a_cache_is_unchanged():
    model = _model()
    idx = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    x = model.embed(idx)
    for block in model.blocks:
        x = block(x)
    assert torch.equal(model(idx), model.head(x))


def test_cache_bytes_are_the_formula():
    model = _model()
    cache = KVCache.for_model(model, batch_size=3, max_len=40)
    assert cache.nbytes == 3 * 40 * kv_bytes_per_token_of(CFG, dtype_bytes=4)


def test_bad_input_raises():
    model = _model()
    cache = KVCache.for_model(model, batch_size=2, max_len=8)
    with pytest.raises(ValueError, match="batch_size=2"):
        model(torch.zeros(3, 1, dtype=torch.long), kv_cache=cache)
    model(torch.zeros(2, 8, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="max_len=8"):
        model(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="seq_len=48"):
        model.embed(torch.zeros(1, 1, dtype=torch.long), pos=torch.tensor([48]))
    with pytest.raises(ValueError, match="seq_len=48"):
        generate(model, torch.zeros(1, 40, dtype=torch.long), 9)
    with pytest.raises(ValueError, match="max_len"):
        KVCache(2, 1, 2, 16, 0)


def test_a_step_the_model_refuses_leaves_the_cache_as_it_was():
    model = _model(torch.float64)
    idx = torch.randint(0, CFG.vocab_size, (1, 48), generator=torch.Generator().manual_seed(4))
    cache = KVCache.for_model(model, 1, max_len=60)  # room past the model's 48 positions
    with torch.no_grad():
        model(idx[:, :40], kv_cache=cache)
        with pytest.raises((ValueError, IndexError)):  # however the model words it
            model(idx[:, :10], kv_cache=cache)  # positions 40..49: refused by the model
        assert cache.length == 40
        step = model(idx[:, 40:], kv_cache=cache)  # the next valid step sees the right context
        full = model(idx)
    # fp64: only the summation order of the attention differs between the two paths
    torch.testing.assert_close(step, full[:, 40:], rtol=1e-10, atol=1e-10)


def test_booleans_are_not_counts():
    model = _model()
    with pytest.raises(ValueError, match="max_new_tokens=True"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), True)
    with pytest.raises(ValueError, match="batch_size=True"):
        KVCache(2, True, 2, 16, 8)
    with pytest.raises(TypeError, match="use_cache='no'"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 2, use_cache="no")


@pytest.mark.parametrize("prompt, words", [
    (torch.tensor([1, 2, 3]), "shape (3,)"),  # once an IndexError from prompt.size(1)
    ([[1, 2, 3]], "got list"),  # once an AttributeError
    (torch.tensor([[1.0, 2.0]]), "torch.float32"),  # once a RuntimeError from the embedding
    (torch.zeros(1, 0, dtype=torch.long), "shape (1, 0)"),  # once a RuntimeError from a reshape
])
def test_generate_refuses_a_prompt_that_is_not_token_ids(prompt, words):
    with pytest.raises(ValueError, match=re.escape("prompt must be a (B, T0) integer tensor")) as err:
        generate(_model(), prompt, 2)
    assert words in str(err.value)


def test_a_cache_for_another_model_or_of_no_length_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="max_len=0"):
        KVCache.for_model(model, 1, max_len=0)  # once silently taken as seq_len
    with pytest.raises(TypeError, match="dtype=torch.int64"):
        KVCache(2, 1, 2, 16, 8, dtype=torch.int64)
    other = KVCache(CFG.n_layer, 1, CFG.n_head, 8, 8)  # head_dim 8, the model's is 16
    with pytest.raises(ValueError, match="built for another model"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=other)  # once a RuntimeError in a copy
    assert other.length == 0


# --- the Llama family: grouped-query attention and rotary positions through the cache ------------------
LLAMA = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, seq_len=48, vocab_size=64,
                  norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, bias=False)


def _llama(n_kv_head=2):
    torch.manual_seed(0)
    return build_model(GPTConfig(**{**LLAMA.to_dict(), "n_kv_head": n_kv_head}), dtype=torch.float64).eval()


class _PositionsFromZero(KVCache):
    """A deliberately wrong cache: every chunk's rotary positions restart at 0."""

    def begin(self, idx):
        return super().begin(idx) - self.length


@pytest.mark.roundoff
@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_llama_gqa_cached_logits_match_the_full_forward_chunk_by_chunk(n_kv_head):
    model = _llama(n_kv_head)
    idx = torch.randint(0, LLAMA.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    chunks = [(0, 9), (9, 10), (10, 16), (16, 20)]
    with torch.no_grad():
        full = model(idx)  # (B, T, V), recomputed without a cache
        cache = KVCache.for_model(model, 2)
        pieces = [model(idx[:, a:b], kv_cache=cache) for a, b in chunks]
        wrong = KVCache.__new__(_PositionsFromZero)
        wrong.__init__(LLAMA.n_layer, 2, n_kv_head, LLAMA.head_dim, LLAMA.seq_len, dtype=torch.float64)
        unshifted = [model(idx[:, a:b], kv_cache=wrong) for a, b in chunks]
    assert cache.k[0].shape == (2, n_kv_head, LLAMA.seq_len, LLAMA.head_dim)  # n_kv heads kept, not n_head
    # fp64: only the summation order of the attention differs between the two paths
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)
    # rope needs each chunk's positions offset by the cache's length: without it the later chunks
    # miss the same tolerance (the first chunk, at positions 0.., is right either way)
    unshifted = torch.cat(unshifted, dim=1)
    assert torch.allclose(unshifted[:, :9], full[:, :9], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(unshifted[:, 9:], full[:, 9:], rtol=1e-10, atol=1e-10)


def test_llama_gqa_greedy_with_cache_equals_recomputing_every_step():
    model = _llama()
    prompt = torch.randint(0, LLAMA.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate(model, prompt, 30), generate(model, prompt, 30, use_cache=False))


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_gqa_cache_bytes_measured_by_the_meter_are_the_formula_with_n_kv_head(n_kv_head):
    from labkit.memory import MemoryMeter
    from labkit.paged_attention import PagedKVCache, kv_bytes

    model, e = _llama(n_kv_head), 8  # float64
    with MemoryMeter() as meter:  # counts every storage allocated, without reading shapes
        cache = KVCache.for_model(model, batch_size=3, max_len=40)  # kept alive while measured
    assert meter.report().peak_bytes == kv_bytes(3 * 40, LLAMA.n_layer, n_kv_head, LLAMA.head_dim, e)
    with MemoryMeter() as meter:
        paged = PagedKVCache.for_model(model, num_blocks=10, block_size=4)
    assert cache.k[0].size(1) == paged.k[0].size(1) == n_kv_head
    assert meter.report().peak_bytes == kv_bytes(10 * 4, LLAMA.n_layer, n_kv_head, LLAMA.head_dim, e)
