"""labkit.mla through the caches: the latent rows they keep, cached and absorbed decoding against
the uncached forward (float64), and the bytes per token of MHA, GQA and MLA as the meter counts
them. labkit's MLA against Hugging Face's DeepSeek-V3: tests/test_moe_hf.py."""

from __future__ import annotations

import pytest
import torch

from labkit.memory import MemoryMeter
from labkit.model import GPTConfig, build_model, count_params
from labkit.paged_attention import (KVCache, PagedKVCache, generate, kv_bytes, kv_bytes_per_token,
                                    kv_bytes_per_token_of, mla_kv_bytes_per_token)
from labkit.shapes import ModelShape

LLAMA = dict(n_layer=2, n_head=4, d_model=32, d_ff=48, vocab_size=64, seq_len=24, norm="rmsnorm",
             mlp="swiglu", pos="rope", bias=False, tie_embeddings=False)
MLA = dict(LLAMA, kv_lora_rank=10, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)
CHUNKS = [(0, 9), (9, 10), (10, 16), (16, 20)]  # a prompt, one token, a chunk, a chunk


def _model(q_lora_rank=0, **kw):
    torch.manual_seed(0)
    model = build_model(GPTConfig(**{**MLA, "q_lora_rank": q_lora_rank, **kw}), dtype=torch.float64).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: every part of the attention shows
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def _close(actual, expected):
    # float64: the paths differ only in summation order (and, absorbed, in the order of the
    # matmuls: (q W^UK) c against q (W^UK c)), ~1e-15 of the logits; a wrong position, a
    # missing rotary key or a wrong scale is above 1e-3
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10 * expected.abs().max().item())


@pytest.mark.parametrize("q_lora_rank", [0, 6])
def test_count_params_is_the_models_parameters(q_lora_rank):
    for extra in ({}, {"n_experts": 4, "experts_per_token": 2, "first_dense_layers": 1}):
        model = _model(q_lora_rank, **extra)
        assert sum(p.numel() for p in model.parameters()) == count_params(model.cfg)


@pytest.mark.roundoff
@pytest.mark.parametrize("absorb", [False, True])
def test_contiguous_latent_cache_chunk_by_chunk_equals_the_uncached_forward(absorb):
    model = _model(6)
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)  # (B, T, V): per-head keys and values, AttentionCore
        cache = KVCache.for_model(model, 2, absorb=absorb)
        pieces = torch.cat([model(idx[:, a:b], kv_cache=cache) for a, b in CHUNKS], dim=1)
    _close(pieces, full)
    c, r = MLA["kv_lora_rank"], MLA["qk_rope_head_dim"]
    assert cache.k[0].shape == (2, 1, MLA["seq_len"], c + r) and cache.v == []  # the latent row only
    with torch.no_grad():  # what the rows hold: [c^KV; rotated k^R] of each token
        block = model.blocks[0]
        c_kv = block.attn.kv_norm(block.attn.w_dkv(block.ln_1(model.embed(idx))))  # (B, T, c)
    _close(cache.k[0][:, 0, :20, :c], c_kv)  # computed chunk by chunk there: round-off apart


@pytest.mark.parametrize("absorb", [False, True])
def test_paged_latent_cache_equals_the_uncached_forward(absorb):
    model = _model()
    lengths = [13, 7]  # sequences of different lengths, blocks interleaved
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    cache = PagedKVCache.for_model(model, num_blocks=12, block_size=4, absorb=absorb)
    got = {}
    with torch.no_grad():
        for i, p in enumerate(prompts):  # prefill one by one
            cache.add_sequence(i, p.tolist())
            cache.reserve(i, p.tolist())
            got[i] = [model(p[None], kv_cache=cache.step([i], len(p)))[0]]
        for _ in range(3):  # decode both together
            last = [int(got[i][-1][-1].argmax()) for i in (0, 1)]
            for i in (0, 1):
                cache.reserve(i, [last[i]])
            out = model(torch.tensor(last)[:, None], kv_cache=cache.step([0, 1], 1))  # (2, 1, V)
            for i in (0, 1):
                prompts[i] = torch.cat([prompts[i], torch.tensor(last[i:i + 1])])
                got[i].append(out[i])
        for i in (0, 1):
            _close(torch.cat(got[i]), model(prompts[i][None])[0])
    assert cache.k[0].shape == (12, 1, 4, MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) and cache.v == []


def test_absorbed_decoding_equals_unabsorbed_and_both_generate_the_uncached_tokens():
    model = _model(6)
    prompt = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(2))
    expected = generate(model, prompt, 15, use_cache=False)
    assert torch.equal(generate(model, prompt, 15), expected)
    assert torch.equal(generate(model, prompt, 15, absorb=True), expected)
    attn = model.blocks[1].attn
    q_c, q_r = torch.randn(2, 4, 3, 8, dtype=torch.float64), torch.randn(2, 4, 3, 4, dtype=torch.float64)
    latent = torch.randn(2, 9, 14, dtype=torch.float64)
    plain, absorbed = attn.attend_latent(q_c, q_r, latent, 6), attn.attend_latent(q_c, q_r, latent, 6, True)
    _close(absorbed, plain)
    # the check can fail: the scale of the absorbed query's own width c + d_rope instead
    attn.scale = (10 + 4) ** -0.5
    assert not torch.allclose(attn.attend_latent(q_c, q_r, latent, 6, True), plain, rtol=1e-6)


CASES = {"MHA": dict(LLAMA), "GQA": dict(LLAMA, n_kv_head=1), "MLA": dict(MLA)}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_kv_bytes_per_token_measured_by_the_meter_are_the_formula(kind):
    cfg = GPTConfig(**CASES[kind])
    torch.manual_seed(0)
    model, e = build_model(cfg, dtype=torch.float64).eval(), 8
    with MemoryMeter() as meter:  # counts every storage allocated, without reading shapes
        cache = KVCache.for_model(model, batch_size=3, max_len=20)
    contiguous = meter.report().peak_bytes
    with MemoryMeter() as meter:
        paged = PagedKVCache.for_model(model, num_blocks=5, block_size=4)
    assert cache.nbytes == contiguous and meter.report().peak_bytes == contiguous // 3  # 60 and 20 tokens
    shape = ModelShape.from_config(cfg)
    assert contiguous == 3 * 20 * cfg.n_layer * shape.kv_cache_width() * e == 60 * kv_bytes_per_token_of(cfg, e)
    if kind == "MLA":
        assert contiguous == 60 * mla_kv_bytes_per_token(cfg.n_layer, 10, 4, e) and paged.v == []
    else:
        assert contiguous == kv_bytes(60, cfg.n_layer, cfg.kv_heads, cfg.head_dim, e)
        assert contiguous == 60 * kv_bytes_per_token(cfg.n_layer, cfg.kv_heads, cfg.head_dim, e)


@pytest.mark.parametrize("field", ["kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                   "v_head_dim"])
@pytest.mark.parametrize("bad", [True, -2, 4.0, "4"])
def test_every_mla_field_refuses_bools_floats_strings_and_negatives(field, bad):
    with pytest.raises(ValueError, match=rf"{field}={bad!r} must be an int >= {0 if field == 'q_lora_rank' else 1}"):
        GPTConfig(**{**MLA, field: bad})


def test_what_mla_does_not_model_is_refused_by_name():
    for bad, name in [({"pos": "learned"}, "pos"), ({"bias": True}, "bias"), ({"sliding_window": 4}, "sliding_window"),
                      ({"qk_rope_head_dim": 3}, "qk_rope_head_dim"), ({"n_kv_head": 2}, "n_kv_head")]:
        with pytest.raises(ValueError, match=name):
            GPTConfig(**{**MLA, **bad})
    model, plain = _model(), build_model(GPTConfig(**LLAMA))
    with pytest.raises(ValueError, match="absorb=True"):
        generate(plain, torch.zeros(1, 2, dtype=torch.long), 1, absorb=True)
    with pytest.raises(ValueError, match="latent=False"):  # a cache of keys and values, built by hand
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=KVCache(2, 1, 4, 12, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="latent=True"):
        plain(torch.zeros(1, 2, dtype=torch.long), kv_cache=KVCache(2, 1, 1, 14, 8, latent=True))
    with pytest.raises(ValueError, match="n_kv_head must be 1"):
        PagedKVCache(2, 4, 14, 8, latent=True)
    from labkit.flash_attention import apply_flash_attention
    with pytest.raises(ValueError, match="kv_lora_rank=10"):
        apply_flash_attention(model)


def test_the_serving_engine_serves_an_mla_model_the_tokens_of_plain_generation():
    from labkit.paged_attention import Engine, synthetic_trace

    model = _model(6)
    trace = synthetic_trace(8, max_len=24, rate=0.5, scale=1 / 8, vocab_size=64, seed=3)
    engine = Engine(model, num_blocks=12, block_size=4)
    result = engine.serve(trace)  # batched decodes over latent blocks, preemption and recomputation
    assert engine.cache.v == [] and result.preemptions > 0 and max(result.batch_sizes) > 1
    for rid, req in enumerate(trace):
        want = generate(model, torch.tensor([req.prompt]), req.max_new_tokens, use_cache=False)
        assert result.outputs[rid] == want[0, len(req.prompt):].tolist(), rid


@pytest.mark.parametrize("extra", [{}, {"q_lora_rank": 6},
                                   {"q_lora_rank": 6, "n_experts": 4, "experts_per_token": 2, "first_dense_layers": 1}],
                         ids=["full-rank-query", "q-lora", "q-lora-experts"])
def test_training_flops_equal_the_counted_flops_of_an_mla_step(extra):
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.model import training_flops
    cfg = GPTConfig(**{**MLA, **extra})
    torch.manual_seed(0)
    model, x = build_model(cfg), torch.randint(0, 64, (2, cfg.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    # counted by torch, not by the formula; dropless experts: every token runs its k
    assert counter.get_total_flops() == training_flops(cfg, 2)
