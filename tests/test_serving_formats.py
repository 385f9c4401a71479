"""Serving today's models: weight and KV formats, experts sharded whole, per-layer windows.

Each format's bytes are checked against a tiny model's tensors listed by hand (names and shapes as
a checkpoint stores them), and against the released models' tensors that stay in 16-bit, counted
by hand from their config.json; the planner's answers for Mixtral, DeepSeek-V3 and gpt-oss
follow from them.
"""

from __future__ import annotations

import json
import math

import pytest

from labkit.estimate import serving_memory
from labkit.estimate.formats import WEIGHT_FORMATS, linear_matrices, params_per_rank, weight_bytes
from labkit.hardware import GPUS
from labkit.plan import plan_serving
from labkit.plan.cli import main
from labkit.plan.export import export, to_vllm
from labkit.shapes import ModelShape, preset
from test_in_practice import VLLM_OPTIONS

pytestmark = pytest.mark.filterwarnings("ignore::labkit.plan.export.ExportNote")

# A tiny mixture of experts: 2 layers, h = 256, 4 heads of 64, 2 KV heads, 4 experts of width 384
# (top 2), vocabulary 1000, untied head. Its tensors, as a checkpoint lists them: (out, in).
TINY = ModelShape(n_layer=2, d_model=256, n_head=4, n_kv_head=2, d_ff=384, vocab_size=1000, seq_len=512,
                  norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, bias=False,
                  n_experts=4, experts_per_token=2)
KEPT = {"embed_tokens": (1000, 256), "lm_head": (1000, 256), "norm": (256,)}
MATRICES = {}
for i in range(2):
    KEPT.update({f"{i}.input_layernorm": (256,), f"{i}.post_attention_layernorm": (256,), f"{i}.router": (4, 256)})
    MATRICES.update({f"{i}.q_proj": (256, 256), f"{i}.k_proj": (128, 256), f"{i}.v_proj": (128, 256),
                     f"{i}.o_proj": (256, 256)})
    for e in range(4):
        MATRICES.update({f"{i}.experts.{e}.gate": (384, 256), f"{i}.experts.{e}.up": (384, 256),
                         f"{i}.experts.{e}.down": (256, 384)})


def _numel(shape):
    return math.prod(shape)


def _by_hand(fmt: str) -> int:
    """The tiny model's bytes in ``fmt``, tensor by tensor."""
    kept = 2 * sum(_numel(s) for s in KEPT.values())
    total = kept
    for name, (rows, cols) in MATRICES.items():
        if fmt in ("bf16", "fp16") or (fmt == "mxfp4" and ".experts." not in name):
            total += 2 * rows * cols
        elif fmt == "fp8":  # e4m3 values, an fp32 scale a 128 x 128 block
            total += rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)
        elif fmt == "fp8-per-tensor":
            total += rows * cols + 4
        elif fmt == "int8":  # a 16-bit scale a row
            total += rows * cols + 2 * rows
        elif fmt == "int4-awq":  # 4 bits; a 16-bit scale and a 4-bit zero a group of 128 of a row
            total += rows * cols // 2 + rows * (cols // 128) * 2 + rows * (cols // 128) // 2
        elif fmt == "int4-gptq":  # as AWQ, and g_idx: an int32 an input column
            total += rows * cols // 2 + rows * (cols // 128) * 2 + rows * (cols // 128) // 2 + 4 * cols
        elif fmt == "mxfp4":  # 4 bits, an E8M0 byte a block of 32
            total += rows * cols // 2 + rows * cols // 32
    return total


def test_the_tiny_model_s_tensors_are_its_parameters():
    assert TINY.num_params() == sum(_numel(s) for s in KEPT.values()) + sum(_numel(s) for s in MATRICES.values())
    listed = sum(count * rows * cols for _, rows, cols, count in linear_matrices(TINY))
    assert listed == sum(_numel(s) for s in MATRICES.values())


@pytest.mark.parametrize("fmt", list(WEIGHT_FORMATS))
def test_each_format_s_bytes_equal_the_tensors_counted_by_hand(fmt):
    got = weight_bytes(TINY, fmt)
    assert got.total == _by_hand(fmt), (fmt, got)
    assert got.params == TINY.num_params()


def test_expert_parallelism_holds_whole_experts_and_the_same_bytes_when_t_divides_both():
    # t = 2: each rank holds 2 of the 4 experts whole, or every expert's half
    half = {k: v for k, v in MATRICES.items() if ".experts." not in k}
    attn = sum(_numel(s) for s in half.values()) // 2
    experts = 2 * 2 * 3 * 256 * 384  # 2 layers x 2 experts x 3 matrices
    kept = sum(_numel(s) for s in KEPT.values()) - 2 * 1000 * 256 + 1000 * 256  # vocabulary split by t
    assert params_per_rank(TINY, 2, expert_parallel=True) == attn + experts + kept
    assert params_per_rank(TINY, 2, expert_parallel=False) == attn + experts + kept
    whole = [m for m in linear_matrices(TINY, 2, expert_parallel=True) if m[0] == "expert"]
    sliced = [m for m in linear_matrices(TINY, 2, expert_parallel=False) if m[0] == "expert"]
    assert {(r, c, n) for _, r, c, n in whole} == {(384, 256, 4), (256, 384, 4)}  # 2 layers x 2
    assert {(r, c, n) for _, r, c, n in sliced} == {(192, 256, 8), (256, 192, 8)}
    # group scales: a whole expert's down projection has 3 groups a row, a sliced one 192/128 -> 2
    assert weight_bytes(TINY, "int4-awq", 2, True).scales < weight_bytes(TINY, "int4-awq", 2, False).scales


def test_expert_parallelism_plans_a_t_that_does_not_divide_the_experts_width():
    odd = TINY.replace(d_ff=101)  # width 101: t = 2 cannot slice it, but 4 experts go two a rank
    found = plan_serving(odd, gpu="a100-80gb", num_gpus=2, context_len=512)
    assert [(p.tp_size, p.expert_parallel) for p in found.plans if p.tp_size == 2] == [(2, True)]
    with pytest.raises(ValueError, match="d_expert=101"):
        serving_memory(odd, gpu="a100-80gb", tp_size=2)
    with pytest.raises(ValueError, match="ep_size=2 must divide n_experts=5"):
        serving_memory(TINY.replace(n_experts=5), gpu="a100-80gb", tp_size=2, expert_parallel=True)
    with pytest.raises(ValueError, match="dense"):
        serving_memory("llama-3-8b", gpu="a100-80gb", tp_size=2, expert_parallel=True)


def test_released_models_keep_their_16_bit_tensors_counted_by_hand():
    # Mixtral-8x7B: embedding and head, two norms and an 8-expert router a layer, the final norm
    kept = 2 * 32000 * 4096 + 32 * (2 * 4096 + 8 * 4096) + 4096
    assert weight_bytes(preset("mixtral-8x7b"), "fp8").kept == 2 * kept
    # DeepSeek-V3: + q_a_layernorm (1536) and kv_a_layernorm (512); 58 routers with their bias
    kept = 2 * 129280 * 7168 + 61 * (2 * 7168 + 1536 + 512) + 58 * (256 * 7168 + 256) + 7168
    assert weight_bytes(preset("deepseek-v3"), "fp8").kept == 2 * kept
    # gpt-oss-20b in MXFP4: attention with biases and sinks, norms, router, expert biases stay 16-bit
    attn = 64 * 64 * 2880 + 4096 + 2 * (8 * 64 * 2880 + 512) + 2880 * 4096 + 2880 + 64
    layer = attn + 2 * 2880 + (32 * 2880 + 32) + 32 * (2 * 2880 + 2880)
    kept = 2 * 201088 * 2880 + 24 * layer + 2880
    got = weight_bytes(preset("gpt-oss-20b"), "mxfp4")
    assert got.kept == 2 * kept and got.params == preset("gpt-oss-20b").num_params()
    # 4.25 bits an expert weight: the model card's figure for its MXFP4 (openai2025gptoss)
    assert (got.values + got.scales) * 8 / got.quantized_params == 4.25


def test_mixtral_does_not_fit_one_a100_in_bf16_and_serves_in_fp8_or_int4():
    found = plan_serving("mixtral-8x7b", gpu="a100-80gb", context_len=4096)
    assert not found.plans and "weights" in found.reason()
    assert serving_memory("mixtral-8x7b", gpu="a100-80gb").weights > GPUS["a100-80gb"].memory_bytes
    for fmt in ("fp8", "int4-awq", "int4-gptq"):
        served = plan_serving("mixtral-8x7b", gpu="a100-80gb", context_len=4096, weight_format=fmt)
        assert served.plans and served.plans[0].max_concurrency > 0, fmt


def test_deepseek_v3_is_sized_with_671b_parameters_and_mla_s_cache():
    ds = preset("deepseek-v3")
    assert ds.num_params() == 671_026_419_200 and ds.weight_format == "fp8"
    fp8 = plan_serving(ds, gpu="h200", num_gpus=8, context_len=8192)  # its release's fp8, the default
    assert fp8.plans and fp8.plans[0].weight_format == "fp8" and fp8.plans[0].tp_size == 8
    est = fp8.plans[0].estimate
    assert est.bytes_per_block == 16 * 61 * (512 + 64) * 2  # MLA: kv_lora_rank + rope key, whole on every rank
    assert est.weights == weight_bytes(ds, "fp8", 8).total
    bf16 = plan_serving(ds, gpu="h100-sxm", num_gpus=8, context_len=8192, weight_format="bf16")
    assert not bf16.plans and all(p.bound == "weights" for p in bf16.refused)
    assert {(p.tp_size, p.expert_parallel) for p in bf16.refused} >= {(8, False), (8, True)}
    kv8 = serving_memory(ds, gpu="h200", tp_size=8, kv_format="fp8")
    assert kv8.bytes_per_block * 2 == est.bytes_per_block and kv8.kv_cache == est.kv_cache


def test_gpt_oss_20b_in_mxfp4_serves_on_one_24_gb_gpu_with_per_layer_windows():
    shape = preset("gpt-oss-20b")
    est = serving_memory(shape, gpu="l4")
    assert est.weight_format == "mxfp4" and est.weights < 0.7 * GPUS["l4"].memory_bytes
    # 12 layers of a 128-token window, 12 full ones; a layer block: 16 tokens x 8 KV heads x 64 x 2 x 2
    layer_block = 16 * 2 * 8 * 64 * 2
    assert est.bytes_per_block == 24 * layer_block
    blocks = est.kv_cache // layer_block
    assert est.max_concurrency(8192) == blocks // (12 * 8192 // 16 + 12 * 128 // 16) > 0
    full = serving_memory(shape, gpu="l4", window_cache="full")
    assert full.max_concurrency(8192) == blocks // (24 * 8192 // 16) < est.max_concurrency(8192)
    with pytest.raises(ValueError, match="window_cache='none'"):
        serving_memory(shape, gpu="l4", window_cache="none")


def test_a_format_and_bytes_together_are_refused_by_name():
    with pytest.raises(ValueError, match="weight_format='fp8' and weight_bytes=2"):
        serving_memory("llama-3-8b", gpu="a100-80gb", weight_format="fp8", weight_bytes=2)
    with pytest.raises(ValueError, match="kv_format='fp8' and kv_bytes=1"):
        serving_memory("llama-3-8b", gpu="a100-80gb", kv_format="fp8", kv_bytes=1)
    with pytest.raises(ValueError, match="weight_format='nf4'"):
        serving_memory("llama-3-8b", gpu="a100-80gb", weight_format="nf4")
    # the older flags still count every parameter at their bytes
    assert serving_memory("llama-3-8b", gpu="a100-80gb", weight_bytes=2).weights == \
        2 * preset("llama-3-8b").num_params() == serving_memory("llama-3-8b", gpu="a100-80gb").weights
    with pytest.raises(ValueError, match="weight_format='bitsandbytes'"):
        serving_memory(preset("llama-3-8b").replace(weight_format="bitsandbytes"), gpu="a100-80gb")


def _cli(capsys, *args):
    code = main(["serve", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_names_the_formats_and_says_whether_ep_is_on(tmp_path, capsys):
    code, out, _ = _cli(capsys, "--model", "deepseek-v3", "--gpu", "h200", "--num-gpus", "8", "--context-len", "8192")
    assert code == 0 and "the config's quantization_config (fp8)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("8 ")]
    assert {r[1] for r in rows} == {"on", "off"}
    assert max(len(line) for line in out.splitlines()) <= 80
    path = tmp_path / "config.json"
    from labkit.released_configs import RELEASED
    path.write_text(json.dumps(RELEASED["gpt-oss-20b"][2]))
    code, out, _ = _cli(capsys, "--config", str(path), "--gpu", "l4", "--context-len", "8192", "--json")
    got = json.loads(out)
    assert code == 0 and any("mxfp4" in a and "quantization_config" in a for a in got["model"]["assumed"])
    assert got["plans"][0]["weight_format"] == "mxfp4" and got["plans"][0]["expert_parallel"] is False
    with pytest.raises(SystemExit) as end:
        _cli(capsys, "--model", "llama-3-8b", "--gpu", "a100-80gb", "--context-len", "64", "--kv-format", "fp8",
             "--kv-bytes", "1")
    assert end.value.code == 2 and "--kv-format and --kv-bytes" in capsys.readouterr().err


def test_vllm_arguments_name_the_formats_and_refuse_what_0_8_5_does_not_write():
    plan = plan_serving("mixtral-8x7b", gpu="a100-80gb", num_gpus=2, context_len=4096, weight_format="fp8",
                        kv_format="fp8", expert_parallel=(False,)).plans[0]
    args = to_vllm(plan, model="mistralai/Mixtral-8x7B-v0.1")
    flags = dict(zip(args[1::2], args[2::2]))
    assert flags["--quantization"] == "fp8" and flags["--kv-cache-dtype"] == "fp8" and flags["--dtype"] == "bfloat16"
    assert set(args[1::2]) - {"--data-parallel-size"} <= VLLM_OPTIONS
    ep = plan_serving("mixtral-8x7b", gpu="a100-80gb", num_gpus=2, context_len=4096, weight_format="fp8",
                      expert_parallel=(True,)).plans[0]
    with pytest.raises(ValueError, match="expert_parallel=True"):
        to_vllm(ep)
    oss = export(plan_serving("gpt-oss-20b", gpu="l4", context_len=4096).plans[0], "vllm")
    assert "--quantization" not in oss.config and any("quantization_config" in n for n in oss.notes)
    assert any("hybrid KV cache manager" in n for n in oss.notes)
    int8 = plan_serving("llama-3-8b", gpu="a100-80gb", context_len=4096, weight_format="int8").plans[0]
    with pytest.raises(ValueError, match="weight_format='int8'"):
        to_vllm(int8)


def test_llama_4_s_chunked_layers_cache_at_most_a_chunk():
    scout = preset("llama-4-scout")  # 36 chunked layers of 8192 tokens, every 4th layer full
    est = serving_memory(scout, gpu="h100-sxm", tp_size=8)
    layer_block = 16 * 2 * 1 * 128 * 2  # 8 KV heads over t = 8: one a GPU, of 128, key and value, bf16
    assert est.bytes_per_block == 48 * layer_block
    blocks = est.kv_cache // layer_block
    assert est.max_concurrency(16384) == blocks // (12 * 16384 // 16 + 36 * 8192 // 16)
    assert est.max_concurrency(4096) == blocks // (48 * 4096 // 16)  # shorter than a chunk: all alike
