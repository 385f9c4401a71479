"""Today's released models read from their config.json: counts equal to the published ones, each
family's fields read, every field that is not modelled refused by name; the estimates refuse what
they do not model. Pure Python (no torch), a few milliseconds each."""

from __future__ import annotations

import json
import math

import pytest

from labkit.estimate import serving_memory, training_memory
from labkit.hf_config import SUPPORTED
from labkit.plan import plan_serving, plan_training
from labkit.plan.cli import main
from labkit.released_configs import RELEASED
from labkit.shapes import ModelShape, preset

# The sum of the released tensors, as the Hugging Face Hub reports it for each repository
# ("safetensors.total" of https://huggingface.co/api/models/<repo>), read from public copies:
# debaditc/kvfit scripts/build_registry.py (Llama-3.1-8B, Mistral-Nemo, Phi-3-mini, Qwen2.5-7B,
# Qwen3-32B, Qwen3-30B-A3B, Qwen3-235B-A22B, Gemma-2-9B, gpt-oss-20b and -120b, DeepSeek-V3,
# Llama-4-Scout), zaid-cdlg/inference-atlas test/fixtures/hf/*.api.json (Mixtral-8x7B, with the
# per-dtype split of DeepSeek-V3 and gpt-oss-20b), keras-team/keras-hub's presets' "params"
# (Qwen1.5-MoE-A2.7B, Mixtral-8x7B), and a public table of Hub counts (Mixtral-8x22B-v0.1,
# DeepSeek-V2-Lite). Each one is also printed by a model run that counts model.parameters().
PUBLISHED_EXACT = {
    "llama-3.1-8b": 8_030_261_248,
    "mistral-nemo-12b": 12_247_782_400,
    "phi-3-mini-4k": 3_821_079_552,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-32b": 32_762_123_264,
    "gemma-2-9b": 9_241_705_984,
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_620_634_112,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "deepseek-v2-lite": 15_706_484_224,
    # gpt-oss stores its experts in MXFP4 (U8 blocks of two values); the Hub counts the values:
    # BF16 1,804,459,584 + U8 19,110,297,600 (inference-atlas' gpt-oss-20b.api.json) = the total
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_EXACT))
def test_released_preset_counts_its_published_parameters_exactly(name):
    assert preset(name).num_params() == PUBLISHED_EXACT[name]


def test_gpt_oss_20b_bf16_tensors_are_everything_but_the_experts_matrices():
    # the Hub's split: BF16 1,804,459,584 (attention, router, biases, sinks, norms, embeddings)
    s = preset("gpt-oss-20b")
    experts_matrices = s.n_layer * s.n_experts * 3 * s.d_model * s.expert_dim
    assert experts_matrices == 19_110_297_600 and s.num_params() - experts_matrices == 1_804_459_584


def _fp8_scales(rows: int, cols: int) -> int:
    return math.ceil(rows / 128) * math.ceil(cols / 128)  # one fp32 scale a 128 x 128 block


def test_deepseek_v3_release_is_671b_plus_its_mtp_module_plus_fp8_scales():
    # The Hub's 684,531,386,000 "parameters" are the main model (671B), the multi-token-prediction
    # module (its own embedding and head copies included, DeepSeek's README_WEIGHTS: 11.5B unique
    # + 0.9B + 0.9B), and the fp32 scale of every 128 x 128 block of the fp8 matrices.
    s, (_, _, c) = preset("deepseek-v3"), RELEASED["deepseek-v3"]
    h, a, V = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    qk, v, kvl, ql, r = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"], \
        c["q_lora_rank"], c["qk_rope_head_dim"]
    attn = [(ql, h), (a * qk, ql), (kvl + r, h), (a * (c["qk_nope_head_dim"] + v), kvl), (h, a * v)]
    mlp = lambda f: [(f, h), (f, h), (h, f)]  # gate, up, down
    moe = attn + mlp(c["moe_intermediate_size"]) * (c["n_routed_experts"] + c["n_shared_experts"])
    dense = attn + mlp(c["intermediate_size"])
    layers = [dense] * c["first_k_dense_replace"] + [moe] * (c["num_hidden_layers"] - c["first_k_dense_replace"])
    scales = sum(_fp8_scales(*m) for layer in layers + [moe] for m in layer)  # + the MTP layer's
    mtp = s.layer_params(layer=s.n_layer - 1) + 2 * h * h + 3 * h + 2 * V * h  # eh_proj, 3 norms, embed, head
    assert s.num_params() + mtp + scales == 684_531_386_000
    assert s.n_mtp_layers == 1 and round(s.num_params() / 1e9) == 671  # the paper's 671B


def test_llama_4_scout_is_its_language_model_and_says_so():
    # The release's 108,641,793,536 include the vision encoder and projector, whose parameters
    # follow from vision_config (Llama4VisionModel: patch linear, class and position embeddings,
    # two LayerNorms, 34 ViT layers with biases, the pixel-shuffle MLP and the projector).
    s, (_, _, c) = preset("llama-4-scout"), RELEASED["llama-4-scout"]
    vc, th = c["vision_config"], c["text_config"]["hidden_size"]
    d, f, patch = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    tokens = (vc["image_size"] // patch) ** 2 + 1
    layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    shuffled = int(d / vc["pixel_shuffle_ratio"] ** 2)
    vision = (vc["num_channels"] * patch * patch * d + d + tokens * d + 4 * d + vc["num_hidden_layers"] * layer
              + shuffled * vc["projector_input_dim"] + vc["projector_input_dim"] * vc["projector_output_dim"]
              + vc["vision_output_dim"] * th)
    assert s.num_params() + vision == 108_641_793_536
    assert "text_config" in s.source and "vision" in s.source


@pytest.mark.parametrize("name, published, embedding_out", [
    ("mixtral-8x7b", 12.9, False),  # Jiang et al. 2024: 13B active (model card: 12.9B)
    ("qwen3-30b-a3b", 3.3, False),  # Qwen3 model card: 3.3B activated
    ("qwen1.5-moe-a2.7b", 2.7, False),  # its name and card: 2.7B activated
    ("gpt-oss-20b", 3.6, True),  # OpenAI's model card counts active parameters without the embedding
    ("gpt-oss-120b", 5.1, True),
])
def test_active_parameters_match_the_model_cards(name, published, embedding_out):
    s = preset(name)
    active = s.active_params() - (s.vocab_size * s.d_model if embedding_out else 0)
    assert abs(active / 1e9 - published) < 0.1  # a card's one decimal, rounded (Mixtral) or cut (Qwen3: 3.35)
    assert s.active_params() < s.num_params()


def test_deepseek_v3_active_is_37b_without_its_input_embedding():
    s = preset("deepseek-v3")  # DeepSeek-V3 report: 37B activated for each token
    assert round((s.active_params() - s.vocab_size * s.d_model) / 1e9) == 37
    assert preset("llama-3.1-8b").active_params() == preset("llama-3.1-8b").num_params()  # dense


def test_head_size_and_kv_cache_width_come_from_the_config():
    qwen3 = preset("qwen3-32b")  # 64 heads of 128 on d_model 5120: not 5120 / 64 = 80
    assert qwen3.head_dim == 128 and qwen3.kv_cache_width() == 2 * 8 * 128
    assert preset("mistral-nemo-12b").head_dim == 128  # 5120 / 32 would be 160
    v3 = preset("deepseek-v3")  # MLA caches kv_lora_rank + qk_rope_head_dim, whatever the heads
    assert v3.kv_cache_width() == 512 + 64 and v3.kv_cache_width(tp_size=8) == 576


def test_windows_and_layers_read_by_family():
    assert preset("qwen2.5-7b").sliding_window is None  # use_sliding_window: false
    assert preset("phi-3-mini-4k").sliding_window == 2047 and preset("phi-3-mini-4k").full_attention_every is None
    assert preset("gemma-2-9b").full_attention_every == 2 and preset("gpt-oss-20b").full_attention_every == 2
    scout = preset("llama-4-scout")
    assert (scout.sliding_window, scout.full_attention_every, scout.chunked_attention) == (8192, 4, True)
    v3 = preset("deepseek-v3")
    assert [v3.is_moe_layer(i) for i in range(4)] == [False, False, False, True]


def _config(name: str) -> dict:
    return json.loads(json.dumps(RELEASED[name][2]))


# A planted field per family that would change the answer and is not modelled: refused by name.
@pytest.mark.parametrize("name, change, match", [
    ("llama-3.1-8b", {"mlp_bias": True}, "mlp_bias"),
    ("mistral-nemo-12b", {"attention_bias": True}, "attention_bias"),
    ("mixtral-8x7b", {"num_shared_experts": 1}, "num_shared_experts"),
    ("qwen2.5-7b", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3-32b", {"attention_bias": True}, "attention_bias"),
    ("qwen1.5-moe-a2.7b", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("qwen3-30b-a3b", {"use_sliding_window": True}, "use_sliding_window"),
    ("deepseek-v2-lite", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek-v3", {"head_dim": 96}, "head_dim=96"),
    ("phi-3-mini-4k", {"hidden_act": "gelu"}, "hidden_act"),
    ("gemma-2-9b", {"layer_types": ["full_attention", "sliding_attention"] * 21}, "layer_types"),
    ("gpt-oss-20b", {"layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 22}, "layer_types"),
])
def test_each_family_refuses_a_field_it_does_not_model(name, change, match):
    ModelShape.from_hf_config(_config(name))  # the released config itself is read
    with pytest.raises(ValueError, match=match):
        ModelShape.from_hf_config({**_config(name), **change})


def test_llama4_refuses_a_text_model_field_it_does_not_model():
    c = _config("llama-4-scout")
    c["text_config"]["moe_layers"] = [1, 3]
    with pytest.raises(ValueError, match="moe_layers"):
        ModelShape.from_hf_config(c)


def test_unknown_model_type_and_missing_expert_keys_are_named():
    with pytest.raises(ValueError, match="model_type='mamba'") as err:
        ModelShape.from_hf_config({**_config("qwen3-32b"), "model_type": "mamba"})
    assert "deepseek_v3" in str(err.value) and set(SUPPORTED) >= {"gpt_oss", "llama4", "gemma2"}
    c = _config("mixtral-8x7b")
    del c["num_experts_per_tok"]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelShape.from_hf_config(c)


def test_serving_counts_every_expert_and_mla_cache():
    found = plan_serving("mixtral-8x7b", gpu="a100-80gb", context_len=4096)
    assert not found.plans and found.refused[0].bound == "weights" and "weights" in found.reason()
    # t = 2: everything halves but the router (8 x 4096) and two norms a layer, and the final norm
    whole = 32 * (8 * 4096 + 2 * 4096) + 4096
    est = serving_memory("mixtral-8x7b", gpu="a100-80gb", tp_size=2)
    assert est.weights == 2 * ((PUBLISHED_EXACT["mixtral-8x7b"] - whole) // 2 + whole)
    lite = serving_memory("deepseek-v2-lite", gpu="a100-80gb", block_size=16)
    assert lite.bytes_per_block == 16 * 27 * (512 + 64) * 2  # layers x (kv_lora_rank + rope) x bf16
    # Gemma 2: 21 windowed layers cache at most 4096 tokens, 21 full ones the whole context
    gemma = serving_memory("gemma-2-9b", gpu="a100-80gb")
    layer_blocks = gemma.kv_cache // (gemma.bytes_per_block // 42)
    assert gemma.max_concurrency(8192) == layer_blocks // (21 * 8192 // 16 + 21 * 4096 // 16)
    assert serving_memory("gemma-2-9b", gpu="a100-80gb", window_cache="full").max_concurrency(8192) == \
        layer_blocks // (42 * 8192 // 16)


@pytest.mark.parametrize("name, words", [
    ("qwen1.5-moe-a2.7b", ["shared-expert gate"]), ("qwen3-32b", ["head size", "qk-norm"]),
    ("gpt-oss-20b", ["expert biases"]),
])
def test_training_refuses_what_it_does_not_model_by_name(name, words):
    for call in (lambda: plan_training(name, gpu="h100-sxm", num_gpus=8, seq_len=4096, global_batch=8),
                 lambda: training_memory(name, seq_len=4096, micro_batch=1)):
        with pytest.raises(ValueError) as err:
            call()
        assert all(w in str(err.value) for w in words), str(err.value)
    assert training_memory("qwen2.5-7b", seq_len=64, micro_batch=1).params > 0  # q/k/v biases: modelled


MIXTRAL_ACTIVE = 46_702_792_704 - 32 * (8 - 2) * 3 * 4096 * 14336  # less 6 unchosen experts a layer


def _cli(tmp_path, capsys, config: dict, *args):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SystemExit) as end:
        raise SystemExit(main([args[0], "--config", str(path), *args[1:]]))
    out = capsys.readouterr()
    return end.value.code, out.out, out.err


def test_cli_says_what_it_read_and_refuses_by_name(tmp_path, capsys):
    code, out, err = _cli(tmp_path, capsys, _config("mixtral-8x7b"), "serve", "--gpu", "a100-80gb",
                          "--context-len", "4096")
    assert code == 1 and "weights" in err
    assert f"46.70B parameters, {MIXTRAL_ACTIVE / 1e9:.2f}B active" in out
    assert "experts: 8, 2 a token, width 14336" in out
    assert "8 KV heads, head size 128" in out and out.startswith(f"read {tmp_path}")
    assert all(len(line) <= 80 for line in out.splitlines()[1:])  # after the path given
    code, out, err = _cli(tmp_path, capsys, _config("deepseek-v3"), "train", "--gpu", "h100-sxm",
                          "--num-gpus", "64", "--global-batch", "64", "--seq-len", "4096")
    assert code == 1 and "nothing fits" in err  # 671 B parameters on 64 GPUs: sized, and too big
    assert f"{preset('deepseek-v3').num_params() / 1e9:.2f}B parameters" in out
    assert "multi-token-prediction" in out and "MLA (cache 576 a token a layer)" in out
    # training has no default length: not the config's max_position_embeddings, planned unsaid
    code, _, err = _cli(tmp_path, capsys, _config("qwen2.5-7b"), "train", "--gpu", "h100-sxm",
                        "--num-gpus", "8", "--global-batch", "8")
    longest = _config("qwen2.5-7b")["max_position_embeddings"]
    assert code == 2 and f"--seq-len (no default: this model reads up to {longest} tokens)" in err
    code, out, _ = _cli(tmp_path, capsys, _config("qwen2.5-7b"), "serve", "--gpu", "a100-80gb",
                        "--context-len", "4096", "--json")
    model = json.loads(out)["model"]
    assert code == 0 and model["params"] == PUBLISHED_EXACT["qwen2.5-7b"]
    assert any("use_sliding_window is false" in a for a in model["assumed"])


def test_list_models_shows_total_and_active_within_80_columns(capsys):
    assert main(["--list-models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[0] == "mixtral-8x7b")
    assert "46.70B" in row and f"{MIXTRAL_ACTIVE / 1e9:.2f}B" in row
    assert max(len(line) for line in out.splitlines()) <= 80


def test_defaults_are_the_family_s_and_the_cli_names_them(tmp_path, capsys):
    qwen = _config("qwen2.5-7b")
    del qwen["use_sliding_window"]  # Qwen2's default: false, so its sliding_window is not applied
    assert ModelShape.from_hf_config(qwen).sliding_window is None
    mistral = {**_config("mistral-nemo-12b"), "sliding_window": 4096}  # Mistral applies it everywhere
    assert ModelShape.from_hf_config(mistral).sliding_window == 4096
    code, out, _ = _cli(tmp_path, capsys, mistral, "serve", "--gpu", "a100-80gb", "--context-len", "64")
    assert code == 0 and "  a sliding window of 4096 on every layer" in out  # the window applied, said
    gemma = _config("gemma-2-9b")  # no tie_word_embeddings: Gemma ties (its default); Llama does not
    assert preset("gemma-2-9b").tie_embeddings and not preset("llama-3.1-8b").tie_embeddings
    hand_written = {k: v for k, v in _config("llama-3.1-8b").items() if k != "model_type"}
    code, out, _ = _cli(tmp_path, capsys, hand_written, "serve", "--gpu", "a100-80gb", "--context-len", "64")
    assert code == 0 and "assumed: no model_type: read as a llama config.json" in out
    assert "no tie_word_embeddings" not in out and "tie_word_embeddings" not in json.dumps(gemma)
