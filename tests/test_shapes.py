"""labkit.shapes: published shapes and their exact parameter counts, read without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from labkit.shapes import PRESETS, ModelShape, preset

# Parameter counts of the released checkpoints (the sum of their tensors' sizes), exact.
PUBLISHED_EXACT = {
    "gpt2-small": 124_439_808,
    "opt-13b": 12_853_473_280,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_EXACT))
def test_preset_parameter_count_equals_the_released_checkpoint(name):
    assert preset(name).num_params() == PUBLISHED_EXACT[name]


def test_gpt3_rounds_to_its_published_175b():
    # Brown et al. state "175 billion" only: within 0.5%.
    assert abs(preset("gpt3-175b").num_params() / 175e9 - 1) < 0.005


def test_every_preset_is_valid_and_gqa_divides():
    for name, shape in PRESETS.items():
        assert shape.n_head % shape.kv_heads == 0, name
        assert shape.num_params() > 0, name
    assert preset("llama-2-70b").kv_heads == 8 and preset("llama-2-7b").kv_heads == 32
    assert preset("mistral-7b").sliding_window == 4096


LLAMA3_8B_CONFIG = {  # the fields of meta-llama/Meta-Llama-3-8B's config.json that a shape reads
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}


def test_from_hf_config_reads_a_llama_config():
    shape = ModelShape.from_hf_config(json.loads(json.dumps(LLAMA3_8B_CONFIG)))
    assert shape == preset("llama-3-8b")
    assert shape.num_params() == PUBLISHED_EXACT["llama-3-8b"]
    mha = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "num_key_value_heads"}
    assert ModelShape.from_hf_config(mha).kv_heads == 32  # no num_key_value_heads: multi-head
    no_theta = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "rope_theta"}
    assert ModelShape.from_hf_config(no_theta).rope_theta == 10000.0  # Llama 2's default


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"])
def test_from_hf_config_missing_field_names_it(field):
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != field}
    with pytest.raises(ValueError, match=field):
        ModelShape.from_hf_config(config)


@pytest.mark.parametrize("changes, match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 5}, "n_kv_head=5 must divide n_head=32"),
    ({"num_hidden_layers": True}, "n_layer=True"),
    ({"hidden_size": 4096.0}, "d_model=4096.0"),
])
def test_from_hf_config_refuses_what_it_cannot_model(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelShape.from_hf_config({**LLAMA3_8B_CONFIG, **changes})


@pytest.mark.parametrize("kwargs, error, match", [
    ({"n_layer": 0}, ValueError, "n_layer=0"),
    ({"n_head": 3}, ValueError, "n_head=3 must divide d_model=128"),
    ({"n_kv_head": 3}, ValueError, "n_kv_head=3"),
    ({"norm": "batchnorm"}, ValueError, "norm='batchnorm'"),
    ({"tie_embeddings": "no"}, TypeError, "tie_embeddings='no'"),
    ({"d_ff": True}, ValueError, "d_ff=True"),
    ({"rope_theta": -1.0}, ValueError, "rope_theta=-1.0"),
])
def test_bad_shape_names_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        preset("tiny").replace(**kwargs)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="llama-3-8b"):
        preset("llama-4-8b")


def test_shapes_import_no_torch():
    code = "import sys, labkit.shapes; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
