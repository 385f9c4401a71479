"""The tiny GPT: shapes, the exact parameter count, presets, tied weights, bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from labkit.model import PRESETS, GPTConfig, build_model, count_params, get_preset


@pytest.mark.parametrize("cfg", [GPTConfig(), GPTConfig(n_layer=1, n_head=2, d_model=8, seq_len=5, vocab_size=11),
                                 GPTConfig(n_layer=3, n_head=3, d_model=48, seq_len=16, vocab_size=100)])
def test_count_params_equals_built_model(cfg):
    model = build_model(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())


def test_gpt2_small_has_its_published_size():
    # 124,439,808: GPT-2 small with tied embeddings, the size Hugging Face reports for "gpt2"
    assert count_params(get_preset("gpt2-small")) == 124_439_808


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_on_meta_with_the_counted_parameters(name):
    model = build_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == count_params(get_preset(name))
    assert all(p.device.type == "meta" for p in model.parameters())


def test_presets_on_fake_tensors_run_forward():
    cfg = get_preset("gpt2-medium")
    with FakeTensorMode():
        model = build_model(cfg)
        logits = model(torch.randint(0, cfg.vocab_size, (2, 32)))
    assert logits.shape == (2, 32, cfg.vocab_size)


def test_published_sizes_in_billions():
    # GPT-3 paper, Table 2.1: 175B; GPT-2 XL: 1.5B. Our counts include position embeddings.
    assert round(count_params(get_preset("gpt3-175b")) / 1e9) == 175
    assert round(count_params(get_preset("gpt2-xl")) / 1e9, 1) == 1.6
    assert 6.5e9 < count_params(get_preset("llama-7b-like")) < 6.8e9


def test_the_default_block_is_gpt2s():
    model = build_model("tiny")
    block = model.blocks[0]
    assert isinstance(block.ln_1, torch.nn.LayerNorm) and block.ln_1.bias is not None
    assert block.attn.c_attn.out_features == 3 * 128 and block.attn.rope is None
    assert block.mlp.c_fc.out_features == 4 * 128 and not hasattr(block.mlp, "c_gate")
    assert model.wpe.num_embeddings == 64 and model.lm_head.weight is model.wte.weight
    mask = block.attn.core.causal_mask  # True where a key is visible
    assert torch.equal(mask, torch.ones_like(mask).tril())  # causal only: no window hides the past


def test_embeddings_are_tied_and_loss_is_cross_entropy():
    torch.manual_seed(0)
    model = build_model(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=32))
    assert model.lm_head.weight is model.wte.weight
    x = torch.randint(0, 32, (3, 8))
    y = torch.randint(0, 32, (3, 8))
    logits = model(x)
    assert logits.shape == (3, 8, 32)
    # the same math, computed outside the model: must be identical
    torch.testing.assert_close(model(x, y), F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1)), rtol=0, atol=0)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = build_model(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=32)).eval()
    x = torch.randint(0, 32, (1, 8))
    x2 = x.clone()
    x2[0, 5:] = (x2[0, 5:] + 1) % 32  # change only the future
    # positions 0..4 see the same prefix: same logits up to float reassociation (none here: exact)
    torch.testing.assert_close(model(x)[:, :5], model(x2)[:, :5], rtol=0, atol=0)
    assert not torch.equal(model(x)[:, 5:], model(x2)[:, 5:])


def test_dropout_is_active_only_in_training():
    torch.manual_seed(0)
    model = build_model(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, vocab_size=32, dropout=0.5))
    x = torch.randint(0, 32, (2, 8))
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


def test_build_model_dtype_and_shared_causal_mask():
    model = build_model("tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    masks = {id(b.attn.core.causal_mask) for b in model.blocks}
    assert len(masks) == 1  # one (S, S) mask for every layer, not one per layer
    assert torch.get_default_dtype() == torch.float32  # restored


@pytest.mark.parametrize("kwargs, argument", [
    ({"n_layer": 0}, "n_layer"), ({"d_model": -8}, "d_model"), ({"n_head": 3, "d_model": 8}, "n_head=3"),
    ({"seq_len": 2.5}, "seq_len"), ({"vocab_size": 0}, "vocab_size"), ({"dropout": 1.0}, "dropout"),
])
def test_bad_config_names_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        GPTConfig(**kwargs)


def test_unknown_preset_lists_valid_choices():
    with pytest.raises(ValueError, match=r"preset='gpt5'.*gpt2-small"):
        get_preset("gpt5")


def test_too_long_input_is_refused():
    model = build_model(GPTConfig(n_layer=1, n_head=1, d_model=4, seq_len=4, vocab_size=8))
    with pytest.raises(ValueError, match="seq_len=4"):
        model(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_has_the_cpu_weights_and_one_mask():
    torch.manual_seed(0)
    cpu = build_model("tiny")
    torch.manual_seed(0)
    gpu = build_model("tiny", device="cuda")
    for (name, a), (_, b) in zip(cpu.state_dict().items(), gpu.state_dict().items()):
        assert torch.equal(a, b.cpu()), name  # same generator, same draws: identical
    assert len({b.attn.core.causal_mask.data_ptr() for b in gpu.blocks}) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_forward_and_loss_never_wait_for_the_host():
    # the id and target checks read values only on the CPU: on a GPU they would be a
    # device-to-host copy (a sync) in every step; torch's sync debug mode raises on one
    from labkit.data import batches

    model = build_model(get_preset("tiny", n_layer=1), device="cuda")
    x, y = next(batches(2, 16, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = model(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)
