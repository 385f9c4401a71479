"""The Llama family in labkit's model, against Hugging Face's Llama and Mistral (code shared: none).

A tiny ``LlamaForCausalLM`` / ``MistralForCausalLM`` is built from its config (random weights, no
download), its weights are copied into labkit's GPT, and both run in float64 on the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.data import batches
from labkit.layers import RMSNorm, Rotary, SwiGLU, make_causal_mask, repeat_kv
from labkit.model import PRESETS, GPTConfig, build_model, count_params, get_preset, training_flops
from labkit.shapes import PRESETS as SHAPES
from labkit.shapes import ModelShape
from labkit.paged_attention.contiguous import generate

from hf_reference import hf_module, needs_hf

TINY = dict(n_layer=2, n_head=4, d_model=32, d_ff=48, vocab_size=64, seq_len=16, norm="rmsnorm",
            mlp="swiglu", pos="rope", bias=False, tie_embeddings=False)
CASES = {  # name: (labkit config, Hugging Face class)
    "mha-untied": (GPTConfig(**TINY), "llama"),
    "gqa-tied": (GPTConfig(**{**TINY, "n_kv_head": 2, "tie_embeddings": True,
                              "rope_theta": 500000.0}), "llama"),
    "mqa-untied": (GPTConfig(**{**TINY, "n_kv_head": 1}), "llama"),
    "mistral-window": (GPTConfig(**{**TINY, "n_kv_head": 2, "sliding_window": 5}), "mistral"),
}


def _hf_model(cfg: GPTConfig, family: str):
    kind = hf_module().MistralConfig if family == "mistral" else hf_module().LlamaConfig
    extra = {"sliding_window": cfg.sliding_window} if family == "mistral" else {
        "attention_bias": False, "mlp_bias": False}
    config = kind(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                  num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                  num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq_len,
                  rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, hidden_act="silu",
                  tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa", **extra)
    cls = hf_module().MistralForCausalLM if family == "mistral" else hf_module().LlamaForCausalLM
    model = cls(config).double().eval()
    with torch.no_grad():  # larger weights than the 0.02 init, norms away from 1: every part shows
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    return model


def _copy_hf_into_labkit(hf, model) -> None:
    """Hugging Face's parameter names -> labkit's; q, k and v stack into c_attn as [q; k; v]."""
    src, out = hf.state_dict(), {"wte.weight": hf.state_dict()["model.embed_tokens.weight"]}
    for i in range(len(model.blocks)):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        out[b + "attn.c_attn.weight"] = torch.cat([src[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        for mine, theirs in [("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"),
                             ("attn.c_proj", "self_attn.o_proj"), ("mlp.c_gate", "mlp.gate_proj"),
                             ("mlp.c_fc", "mlp.up_proj"), ("mlp.c_proj", "mlp.down_proj")]:
            out[b + mine + ".weight"] = src[p + theirs + ".weight"]
    out["ln_f.weight"] = src["model.norm.weight"]
    out["lm_head.weight"] = src["lm_head.weight"]
    model.load_state_dict(out, strict=True)


@pytest.fixture
def float64_reference(monkeypatch):
    """Hugging Face rounds two things to float32 whatever the model's dtype: RMSNorm's input and
    the rotary tables (for bf16 training). In a float64 comparison that rounding alone is ~1e-7,
    so the reference's norm and tables run the same formulas in float64 (its attention, GQA,
    rotation, MLP and residual stream are untouched)."""
    def rmsnorm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        d = 2 * self.inv_freq.numel()
        inv_freq = self.config.rope_theta ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)
        freqs = position_ids[..., None].double() * inv_freq  # (B, T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, d): Hugging Face's half-split layout
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    for family, prefix in [("llama", "Llama"), ("mistral", "Mistral")]:
        module = hf_module(f"models.{family}.modeling_{family}")
        monkeypatch.setattr(getattr(module, prefix + "RMSNorm"), "forward", rmsnorm)
        monkeypatch.setattr(getattr(module, prefix + "RotaryEmbedding"), "forward", rotary)


def _close_in_float64(actual, expected):
    # float64: either side's round-off is ~1e-15 of the logits after two layers; a modelling
    # difference (an eps, the rotary pairing, the head grouping, a window) is above 1e-6
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10 * scale)


def _marked(cases, cheapest):
    """The cases, the cheapest one marked for the suite's re-run under another CPU kernel."""
    return [pytest.param(c, marks=pytest.mark.roundoff) if c == cheapest else c for c in cases]


@needs_hf
@pytest.mark.parametrize("case", _marked(sorted(CASES), "gqa-tied"))
def test_logits_equal_hugging_faces_in_float64(case, float64_reference):
    cfg, family = CASES[case]
    torch.manual_seed(0)
    hf = _hf_model(cfg, family)
    model = build_model(cfg, dtype=torch.float64).eval()
    _copy_hf_into_labkit(hf, model)
    assert (model.lm_head.weight is model.wte.weight) == cfg.tie_embeddings
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        expected = hf(idx, use_cache=False).logits  # (B, T, V)
        _close_in_float64(model(idx), expected)
        if cfg.sliding_window:  # the window matters: without it the late positions differ
            wide = build_model(GPTConfig(**{**cfg.to_dict(), "sliding_window": None}), dtype=torch.float64)
            wide.load_state_dict(model.state_dict())
            assert not torch.allclose(wide.eval()(idx)[:, cfg.sliding_window:], expected[:, cfg.sliding_window:])


class PlainCache:
    """The KV-cache protocol in the plainest way: lists of (B, n_kv, t, hs) tensors grown by
    concatenation, one query position at a time, a loop over query heads."""

    def __init__(self, cfg: GPTConfig):
        self.k, self.v, self.length, self.cfg = [None] * cfg.n_layer, [None] * cfg.n_layer, 0, cfg
        self.sliding_window = cfg.sliding_window  # declared: attend() below honours it

    def begin(self, idx):
        self.new = idx.size(1)
        return torch.arange(self.length, self.length + self.new)  # (T,) absolute positions

    def attend(self, layer, q, k, v):
        assert k.size(1) == v.size(1) == self.cfg.kv_heads  # the cache keeps n_kv heads only
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=2)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=2)
        rows = []
        for t in range(q.size(2)):
            p = self.length + t  # this query's position: it sees keys max(0, p - window + 1)..p
            lo = 0 if self.cfg.sliding_window is None else max(0, p - self.cfg.sliding_window + 1)
            heads = []
            for h in range(q.size(1)):
                g = h // (self.cfg.n_head // self.cfg.kv_heads)  # the key-value head of query head h
                keys, values = self.k[layer][:, g, lo:p + 1], self.v[layer][:, g, lo:p + 1]  # (B, n, hs)
                w = torch.softmax(keys @ q[:, h, t, :, None] / q.size(-1) ** 0.5, dim=1)  # (B, n, 1)
                heads.append((w * values).sum(dim=1))  # (B, hs)
            rows.append(torch.stack(heads, dim=1))  # (B, nh, hs)
        if layer == self.cfg.n_layer - 1:
            self.length += self.new
        return torch.stack(rows, dim=2)  # (B, nh, T, hs)


@pytest.mark.parametrize("case", _marked(["gqa-tied", "mistral-window"], "mistral-window"))
def test_decoding_through_a_cache_gives_the_full_forwards_logits(case):
    cfg = CASES[case][0]
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float64).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    cache, prompt = PlainCache(cfg), 6
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        steps = [model(idx[:, :prompt], kv_cache=cache)]  # the prompt, then one token at a time
        steps += [model(idx[:, t:t + 1], kv_cache=cache) for t in range(prompt, cfg.seq_len)]
    # float64 (as above): the cache's keys were rotated once, at their own positions
    _close_in_float64(torch.cat(steps, dim=1), full)


def test_a_windowed_model_refuses_a_cache_that_ignores_its_window():
    model = build_model(CASES["mistral-window"][0]).eval()
    cache = PlainCache(CASES["gqa-tied"][0])  # declares no window
    with pytest.raises(ValueError, match="sliding_window=5"):
        model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)


def test_labkits_contiguous_cache_decodes_a_rotary_model_like_a_full_forward():
    torch.manual_seed(0)
    model = build_model(CASES["mha-untied"][0]).eval()
    prompt = torch.randint(0, 64, (2, 4))
    cached = generate(model, prompt, 10, use_cache=True)
    assert torch.equal(cached, generate(model, prompt, 10, use_cache=False))


def test_rotary_takes_per_sequence_positions():
    rope = Rotary(8, 16, 10000.0)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 1, 3, 8)
    pos = torch.tensor([[5, 6, 7], [0, 1, 2]])  # (B, T): each sequence at its own offset
    q2, k2 = rope(q, k, pos)
    for b in range(2):
        qb, kb = rope(q[b:b + 1], k[b:b + 1], pos[b])
        assert torch.equal(q2[b:b + 1], qb) and torch.equal(k2[b:b + 1], kb)  # same products
    # a rotation keeps each pair's length: norms unchanged up to float32 rounding
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))


def test_sliding_window_mask_and_repeat_kv_by_their_definitions():
    mask = make_causal_mask(6, sliding_window=3)
    assert [[bool(mask[i, j]) for j in range(6)] for i in range(6)] == [
        [not (0 <= i - j < 3) for j in range(6)] for i in range(6)]
    x = torch.randn(2, 3, 5, 4)
    y = repeat_kv(x, 2)  # query head h reads key-value head h // 2
    assert all(torch.equal(y[:, h], x[:, h // 2]) for h in range(6))


def test_llama_3_8b_has_its_published_size_built_on_meta():
    cfg = get_preset("llama-3-8b")
    assert count_params(cfg) == 8_030_261_248  # the released checkpoint's tensors, summed
    model = build_model(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    attn = model.blocks[0].attn
    assert attn.c_attn.out_features == (32 + 2 * 8) * 128 and attn.q_per_kv == 4
    assert model.wpe is None and model.lm_head.weight is not model.wte.weight
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    assert isinstance(model.ln_f, RMSNorm) and isinstance(model.blocks[0].mlp, SwiGLU)
    assert model.blocks[0].attn.rope is model.blocks[-1].attn.rope  # one table for all layers


def test_every_published_shape_the_block_runs_is_a_runnable_preset_with_the_same_fields():
    runnable = {name: shape for name, shape in SHAPES.items() if not shape.features()}
    for name, shape in runnable.items():
        assert ModelShape.from_config(PRESETS[name]) == shape, name
    assert {"llama-2-70b", "llama-3.1-405b", "mistral-7b", "opt-13b"} <= set(PRESETS)
    # a shape with experts, MLA, its own head size, ... is never built as a dense GPT by mistake
    assert set(PRESETS) - {"llama-7b-like"} == set(runnable) and "mixtral-8x7b" in SHAPES


def test_a_published_llama_shape_trains_a_step_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = get_preset("mistral-7b", n_layer=1, seq_len=256, sliding_window=128)  # GQA, a window
    with FakeTensorMode():  # real sizes, nothing allocated (how the estimator's tests trace)
        model = build_model(cfg, dtype=torch.bfloat16)
        x = torch.randint(0, cfg.vocab_size, (1, 256))
        model(x, x).backward()
        grad = model.blocks[0].attn.c_attn.weight.grad
    assert grad.shape == (4096 + 2 * 8 * 128, 4096) and grad.dtype == torch.bfloat16


def test_layernorm_without_bias_and_a_gelu_mlp_of_width_d_ff():
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, vocab_size=32, bias=False, d_ff=24)
    model = build_model(cfg)
    assert model.ln_f.bias is None and model.blocks[0].mlp.c_fc.out_features == 24
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)


def test_training_flops_equal_the_counted_flops_of_a_llama_step():
    cfg, batch = CASES["gqa-tied"][0], 3
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    assert counter.get_total_flops() == training_flops(cfg, batch)  # counted, not the formula


def test_a_tiny_llama_learns_the_corpus_and_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    cfg = GPTConfig(**{**TINY, "n_kv_head": 2, "vocab_size": 256, "seq_len": 32})
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(8, cfg.seq_len, seed=0)
    held_out = next(batches(16, cfg.seq_len, seed=1))
    with torch.no_grad():
        before = model(*held_out).item()
    for step in range(30):
        opt.zero_grad()
        model(*next(data)).backward()
        if step == 0:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        opt.step()
    with torch.no_grad():
        after = model(*held_out).item()
    assert after < before - 0.5, (before, after)  # log 256 = 5.5 at start; bytes are far from uniform


@pytest.mark.parametrize("kwargs, match", [
    ({"norm": "batchnorm"}, "norm='batchnorm'"), ({"mlp": "relu"}, "mlp='relu'"),
    ({"pos": "alibi"}, "pos='alibi'"), ({"n_kv_head": 3}, "n_kv_head=3 must divide n_head=4"),
    ({"n_kv_head": True}, "n_kv_head=True"), ({"d_ff": 0}, "d_ff=0"),
    ({"rope_theta": 0.0}, "rope_theta=0.0"), ({"tie_embeddings": "no"}, "tie_embeddings='no'"),
    ({"bias": 1}, "bias=1"), ({"sliding_window": 0}, "sliding_window=0"),
    ({"norm_eps": -1e-5}, "norm_eps"), ({"pos": "rope", "d_model": 12, "n_head": 4}, "even head_dim"),
])
def test_bad_llama_fields_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


# --- techniques that implement GPT-2's block only refuse the Llama fields they would get wrong ------------
LLAMA_TINY = dict(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=64, norm="rmsnorm", mlp="swiglu",
                  d_ff=48, pos="rope", n_kv_head=2, tie_embeddings=False, bias=False)


def _refuses(fn, model, match):
    with pytest.raises(ValueError, match=match):
        fn(model)


def test_techniques_refuse_what_they_do_not_implement(tmp_path):
    import torch.distributed as dist
    from labkit.flash_attention import apply_flash_attention
    from labkit.paged_attention import Engine, KVCache, PagedKVCache
    from labkit.pipeline.split import build_chunks, split_stages
    from labkit.tensor_parallel import apply_tensor_parallel

    llama = build_model(GPTConfig(**LLAMA_TINY))
    assert not build_chunks(llama, split_stages(llama, 2), 2, 0)[0].tied_embeddings  # split: test_llama_techniques
    windowed = build_model(GPTConfig(**{**LLAMA_TINY, "sliding_window": 4}))
    _refuses(lambda m: KVCache.for_model(m, 1), windowed, r"KVCache .*sliding_window=4")
    _refuses(lambda m: PagedKVCache.for_model(m, 4), windowed, r"PagedKVCache .*sliding_window=4")
    _refuses(lambda m: Engine(m, num_blocks=4), windowed, "PagedKVCache")
    _refuses(apply_flash_attention, windowed, r"apply_flash_attention .*sliding_window=4")
    apply_flash_attention(build_model(GPTConfig(**LLAMA_TINY)))  # rope, GQA, SwiGLU: the core is all it swaps
    KVCache.for_model(build_model(GPTConfig(**{**LLAMA_TINY, "n_kv_head": None})), 1)  # rope MHA decodes
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert apply_tensor_parallel(llama, dist.group.WORLD).tp_size == 1  # sharded: test_llama_techniques
        gpt2 = apply_tensor_parallel(build_model(GPTConfig(**{k: LLAMA_TINY[k] for k in
                                     ("n_layer", "n_head", "d_model", "seq_len", "vocab_size")})),
                                     dist.group.WORLD)
        assert gpt2.tp_size == 1
    finally:
        dist.destroy_process_group()
