"""labkit's mixture-of-experts blocks against Hugging Face's, weights copied, in float64.

Mixtral: the whole ``MixtralForCausalLM`` (every layer MoE) against labkit's GPT. DeepSeek-V3:
its MoE block alone (``DeepseekV3MoE``: sigmoid router with the selection bias, renormalised and
scaled weights, shared experts) against labkit's :class:`labkit.moe.MoE`, then the whole
``DeepseekV3ForCausalLM`` (MLA, a dense first layer, then MoE) against labkit's GPT with
:mod:`labkit.mla`.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from labkit.model import GPTConfig, build_model
from labkit.moe import MoE

from hf_reference import hf_module, needs_hf

pytestmark = needs_hf
MIXTRAL, DEEPSEEK_V3 = "models.mixtral.modeling_mixtral", "models.deepseek_v3.modeling_deepseek_v3"

TINY = dict(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, vocab_size=64, seq_len=16, norm="rmsnorm",
            mlp="swiglu", pos="rope", bias=False, tie_embeddings=False, n_experts=4, experts_per_token=2)


@pytest.fixture
def float64_mixtral(monkeypatch):
    """Hugging Face rounds three things to float32 whatever the model's dtype: RMSNorm's input,
    the rotary tables and the router's softmax (for bf16 training). In float64 that rounding alone
    is ~1e-7, so the reference runs those formulas in float64; its attention, routing (top-k,
    renormalisation, the loop over experts) and residual stream are untouched."""
    def rmsnorm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        d = 2 * self.inv_freq.numel()
        inv_freq = self.config.rope_theta ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)
        emb = torch.cat((position_ids[..., None].double() * inv_freq,) * 2, dim=-1)  # (B, T, d)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    functional = types.SimpleNamespace(**{n: getattr(F, n) for n in dir(F) if not n.startswith("__")})
    functional.softmax = lambda x, dim, dtype=None: F.softmax(x, dim=dim)  # in the input's dtype
    mixtral = hf_module(MIXTRAL)
    monkeypatch.setattr(mixtral.MixtralRMSNorm, "forward", rmsnorm)
    monkeypatch.setattr(mixtral.MixtralRotaryEmbedding, "forward", rotary)
    monkeypatch.setattr(mixtral, "F", functional)


def _randomise(model):
    with torch.no_grad():  # larger weights than the 0.02 init, norms away from 1: every part shows
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))


def _mixtral(cfg):
    config = hf_module().MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token, sliding_window=None,
        tie_word_embeddings=False, router_jitter_noise=0.0, attn_implementation="sdpa")
    model = hf_module().MixtralForCausalLM(config).double().eval()
    _randomise(model)
    return model


def _stack(src, prefix, names, n):
    return torch.stack([src[f"{prefix}experts.{e}.{names}.weight"] for e in range(n)])  # (E, ...)


def _copy_mixtral(hf, model) -> None:
    src, out = hf.state_dict(), {"wte.weight": hf.state_dict()["model.embed_tokens.weight"]}
    for i in range(len(model.blocks)):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        out[b + "attn.c_attn.weight"] = torch.cat([src[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        for mine, theirs in [("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"),
                             ("attn.c_proj", "self_attn.o_proj"), ("mlp.router", "block_sparse_moe.gate")]:
            out[b + mine + ".weight"] = src[p + theirs + ".weight"]
        moe, n = p + "block_sparse_moe.", model.cfg.n_experts
        for mine, theirs in [("c_gate", "w1"), ("c_fc", "w3"), ("c_proj", "w2")]:
            out[b + f"mlp.experts.{mine}"] = _stack(src, moe, theirs, n)
    out["ln_f.weight"], out["lm_head.weight"] = src["model.norm.weight"], src["lm_head.weight"]
    model.load_state_dict(out, strict=True)


def _close_in_float64(actual, expected):
    # float64: either side's round-off is ~1e-15 of the output; a modelling difference (a weight
    # not renormalised, a wrong expert, the bias in the weights, a missing scale) is above 1e-3
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10 * scale)


@pytest.mark.parametrize("k", [1, 2])
def test_mixtral_logits_equal_hugging_faces_in_float64(k, float64_mixtral):
    cfg = GPTConfig(**{**TINY, "experts_per_token": k})
    torch.manual_seed(0)
    hf = _mixtral(cfg)
    model = build_model(cfg, dtype=torch.float64).eval()
    _copy_mixtral(hf, model)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        _close_in_float64(model(idx), hf(idx, use_cache=False).logits)


def _float64_router(self, hidden_states):
    """DeepseekV3TopkRouter.forward with its float32 casts removed (the rest is its own code path:
    get_topk_indices with the bias, renormalisation, the scale)."""
    hidden_states = hidden_states.view(-1, self.config.hidden_size)
    scores = F.linear(hidden_states, self.weight).sigmoid()
    topk_indices = self.get_topk_indices(scores)
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_indices, topk_weights * self.routed_scaling_factor


@pytest.mark.parametrize("shared", [1, 2])
def test_deepseek_v3_moe_block_equals_hugging_faces_in_float64(shared, monkeypatch):
    monkeypatch.setattr(hf_module(DEEPSEEK_V3).DeepseekV3TopkRouter, "forward", _float64_router)
    cfg = GPTConfig(**{**TINY, "n_experts": 8, "experts_per_token": 2, "d_expert": 12, "n_shared_experts": shared,
                       "router_score": "sigmoid", "router_bias": True, "routed_scaling_factor": 2.5})
    config = hf_module().DeepseekV3Config(
        hidden_size=cfg.d_model, moe_intermediate_size=cfg.d_expert, n_routed_experts=cfg.n_experts,
        num_experts_per_tok=cfg.experts_per_token, n_shared_experts=shared, routed_scaling_factor=2.5,
        n_group=1, topk_group=1, norm_topk_prob=True, hidden_act="silu")
    torch.manual_seed(0)
    hf = hf_module(DEEPSEEK_V3).DeepseekV3MoE(config).double().eval()
    _randomise(hf)
    with torch.no_grad():  # a bias large enough to change choices: it must steer, not weigh
        hf.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.n_experts, dtype=torch.float64))
    layer = MoE(cfg).double().eval()
    src = hf.state_dict()
    out = {"router.weight": src["gate.weight"], "expert_bias": src["gate.e_score_correction_bias"],
           "shared.c_gate.weight": src["shared_experts.gate_proj.weight"],
           "shared.c_fc.weight": src["shared_experts.up_proj.weight"],
           "shared.c_proj.weight": src["shared_experts.down_proj.weight"]}
    for mine, theirs in [("c_gate", "gate_proj"), ("c_fc", "up_proj"), ("c_proj", "down_proj")]:
        out[f"experts.{mine}"] = _stack(src, "", theirs, cfg.n_experts)
    layer.load_state_dict(out, strict=True)
    x = torch.randn(2, 16, cfg.d_model, dtype=torch.float64)
    with torch.no_grad():
        expected = hf(x)
        _close_in_float64(layer(x), expected)
        layer.expert_bias.zero_()  # the check can fail: without the bias other experts are chosen
        assert not torch.allclose(layer(x), expected)


MLA = dict(n_layer=2, n_head=4, d_model=32, d_ff=48, vocab_size=64, seq_len=16, norm="rmsnorm", mlp="swiglu",
           pos="rope", bias=False, tie_embeddings=False, n_experts=8, experts_per_token=2, d_expert=12,
           n_shared_experts=1, router_score="sigmoid", router_bias=True, routed_scaling_factor=2.5,
           first_dense_layers=1, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)


@pytest.fixture
def float64_deepseek(monkeypatch):
    """The float32 roundings of the Mixtral fixture, undone the same way in DeepSeek-V3's code (its
    RMSNorm, rotary tables and router); its MLA, interleaved rotation, routing and residual stream
    are untouched."""
    def rmsnorm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        d = 2 * self.inv_freq.numel()
        inv_freq = self.config.rope_theta ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)
        emb = torch.cat((position_ids[..., None].double() * inv_freq,) * 2, dim=-1)  # (B, T, d)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    deepseek = hf_module(DEEPSEEK_V3)
    monkeypatch.setattr(deepseek.DeepseekV3RMSNorm, "forward", rmsnorm)
    monkeypatch.setattr(deepseek.DeepseekV3RotaryEmbedding, "forward", rotary)
    monkeypatch.setattr(deepseek.DeepseekV3TopkRouter, "forward", _float64_router)


def _deepseek(cfg):
    config = hf_module().DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        moe_intermediate_size=cfg.d_expert, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head, n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.n_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, n_group=1, topk_group=1,
        num_experts_per_tok=cfg.experts_per_token, first_k_dense_replace=cfg.first_dense_layers,
        norm_topk_prob=True, max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, rope_interleave=True, attention_bias=False, tie_word_embeddings=False,
        attn_implementation="sdpa")
    model = hf_module().DeepseekV3ForCausalLM(config).double().eval()
    _randomise(model)
    with torch.no_grad():  # a selection bias large enough to change choices
        for layer in model.model.layers[cfg.first_dense_layers:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.n_experts, dtype=torch.float64))
    return model


def _per_head(w, a, sizes):
    """Rows of a per-head projection (a (d1 + d2 + ...), n) split into (a d1, n), (a d2, n), ..."""
    return [part.reshape(-1, w.size(-1)) for part in w.view(a, sum(sizes), -1).split(sizes, dim=1)]


def _copy_mla(src, p, b, cfg, out) -> None:
    """Hugging Face's fused MLA projections -> the paper's matrices (labkit.mla), by rows."""
    a, r, dn = cfg.n_head, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    q = src[p + ("q_b_proj" if cfg.q_lora_rank else "q_proj") + ".weight"]
    out[b + "w_uq.weight"], out[b + "w_qr.weight"] = _per_head(q, a, [dn, r])
    if cfg.q_lora_rank:
        out[b + "w_dq.weight"], out[b + "q_norm.weight"] = src[p + "q_a_proj.weight"], src[p + "q_a_layernorm.weight"]
    out[b + "w_dkv.weight"], out[b + "w_kr.weight"] = src[p + "kv_a_proj_with_mqa.weight"].split(
        [cfg.kv_lora_rank, r])
    out[b + "kv_norm.weight"], out[b + "c_proj.weight"] = src[p + "kv_a_layernorm.weight"], src[p + "o_proj.weight"]
    out[b + "w_uk.weight"], out[b + "w_uv.weight"] = _per_head(src[p + "kv_b_proj.weight"], a, [dn, cfg.v_head_dim])


def _copy_deepseek(hf, model) -> None:
    src, cfg = hf.state_dict(), model.cfg
    out = {"wte.weight": src["model.embed_tokens.weight"], "ln_f.weight": src["model.norm.weight"],
           "lm_head.weight": src["lm_head.weight"]}
    for i in range(cfg.n_layer):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        _copy_mla(src, p + "self_attn.", b + "attn.", cfg, out)
        out[b + "ln_1.weight"], out[b + "ln_2.weight"] = src[p + "input_layernorm.weight"], \
            src[p + "post_attention_layernorm.weight"]
        names = [("c_gate", "gate_proj"), ("c_fc", "up_proj"), ("c_proj", "down_proj")]
        if i < cfg.first_dense_layers:
            out.update({b + f"mlp.{mine}.weight": src[p + f"mlp.{theirs}.weight"] for mine, theirs in names})
            continue
        out[b + "mlp.router.weight"], out[b + "mlp.expert_bias"] = src[p + "mlp.gate.weight"], \
            src[p + "mlp.gate.e_score_correction_bias"]
        for mine, theirs in names:
            out[b + f"mlp.shared.{mine}.weight"] = src[p + f"mlp.shared_experts.{theirs}.weight"]
            out[b + f"mlp.experts.{mine}"] = _stack(src, p + "mlp.", theirs, cfg.n_experts)
    model.load_state_dict(out, strict=True)


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_deepseek_v3_logits_equal_hugging_faces_in_float64(q_lora_rank, float64_deepseek):
    cfg = GPTConfig(**{**MLA, "q_lora_rank": q_lora_rank})
    torch.manual_seed(0)
    hf = _deepseek(cfg)
    model = build_model(cfg, dtype=torch.float64).eval()
    _copy_deepseek(hf, model)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        expected = hf(idx, use_cache=False).logits  # (B, T, V)
        _close_in_float64(model(idx), expected)
        model.blocks[0].attn.rope.interleaved = False  # the check can fail: half-split pairs differ
        assert not torch.allclose(model(idx), expected, rtol=1e-6, atol=1e-6)
