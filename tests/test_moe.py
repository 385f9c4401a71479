"""labkit.moe against a dense reference that shares none of its code (tests/moe_reference.py).

The layer sorts assignments by expert and runs each expert on its rows only; the reference runs
every expert on every token and weighs the outputs by a dense gate matrix. Both in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.model import GPTConfig, build_model, count_params
from labkit.moe import (MoE, all_to_all_bytes, dispatched_rows, expert_capacity, keep_mask, load_balancing_loss,
                        moe_flops_per_token, moe_layers, param_counts, route, update_bias, update_expert_bias)
from moe_reference import reference_balance_loss, reference_gates, reference_moe

BASE = dict(n_layer=2, n_head=4, d_model=16, d_ff=40, vocab_size=64, seq_len=8, norm="rmsnorm", mlp="swiglu",
            pos="rope", bias=False, tie_embeddings=False, n_experts=4, experts_per_token=2, d_expert=12)
CASES = {  # name: the expert fields over BASE
    "mixtral": {},
    "top1-unnormalised": {"experts_per_token": 1, "norm_topk_prob": False},
    "deepseek": {"router_score": "sigmoid", "router_bias": True, "routed_scaling_factor": 2.5,
                 "n_shared_experts": 2, "first_dense_layers": 1},
    "capacity-1.0": {"capacity_factor": 1.0},
    "capacity-0.5-sigmoid": {"capacity_factor": 0.5, "router_score": "sigmoid", "norm_topk_prob": False},
}


def assert_same_to_float64(got, want, what):
    """Equal up to float64 round-off, judged against the tensor's scale: in a gradient of size
    1e3 summed in another order, an element near 1 differs by a few 1e-12 (seen on an AVX2 CPU),
    so an element-by-element relative bound would judge the order of the sum, not the result.
    1e-12 of the scale: the largest error measured is 1.5e-14 of it, a wrong weight over 1e-2."""
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= 1e-12 * scale, f"{what}: max error {err:.3g} > 1e-12 x its scale {scale:.3g}"


def _layer(case):
    torch.manual_seed(0)
    cfg = GPTConfig(**{**BASE, **CASES[case]})
    layer = MoE(cfg).double()
    with torch.no_grad():  # weights large enough that the routing is far from uniform
        for p in layer.parameters():
            p.normal_(0, 0.5)
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    return cfg, layer


def _reference(cfg, layer, x):
    e = layer.experts
    return reference_moe(x, layer.router.weight, e.c_gate, e.c_fc, e.c_proj, cfg.experts_per_token,
                         shared=layer.shared, score=cfg.router_score, normalize=cfg.norm_topk_prob,
                         bias=layer.expert_bias, scaling=cfg.routed_scaling_factor,
                         capacity_factor=cfg.capacity_factor)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_layer_and_its_gradients_equal_the_dense_reference(case):
    cfg, layer = _layer(case)
    x = torch.randn(3, 8, cfg.d_model, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    params = [x] + list(layer.parameters())
    grads = torch.autograd.grad((y * torch.cos(y)).sum(), params)
    x2 = x.detach().clone().requires_grad_()
    expected = _reference(cfg, layer, x2.view(-1, cfg.d_model)).view_as(y)
    expected_grads = torch.autograd.grad((expected * torch.cos(expected)).sum(), [x2] + params[1:])
    # float64: the two sum the same products in other orders (a sorted index_add against a dense
    # sum over E experts, zeros included): at most ~1.5e-14 of the tensor's scale; a wrong weight,
    # choice or drop is > 1e-2 of it
    assert_same_to_float64(y, expected, "output")
    for name, g, e in zip(["x"] + [n for n, _ in layer.named_parameters()], grads, expected_grads):
        assert_same_to_float64(g, e, name)
    dropped = 3 * 8 * cfg.experts_per_token - layer.kept
    assert (dropped > 0) == (cfg.capacity_factor is not None)  # the capacity cases do drop


def test_keep_mask_serves_every_first_choice_before_any_second_choice():
    experts = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 1]])  # (N=4, k=2); capacity ceil(1 * 8 / 3) = 3
    keep = keep_mask(experts, 3, 1.0)
    # expert 0's queue: first choices of tokens 0, 2, 3 (full), then token 1's second choice: dropped
    assert keep.tolist() == [[True, True], [True, False], [True, True], [True, True]]
    gates, _ = reference_gates(torch.tensor([[3.0, 2, 1], [2, 3, 1], [3, 1, 2], [3, 2, 1]]), 2, capacity_factor=1.0)
    assert (gates > 0).tolist() == [[True, True, False], [False, True, False], [True, False, True], [True, True, False]]
    assert keep_mask(experts, 3, None) is None  # dropless


def test_capacity_rounds_up():
    assert expert_capacity(10, 4, 1, 1.0) == 3  # 2.5 rows: rounded up, so balanced routing drops none
    assert expert_capacity(8, 4, 2, 1.25) == 5 and expert_capacity(0, 4, 2, 1.0) == 0
    with pytest.raises(ValueError, match="capacity_factor=0 must be"):
        expert_capacity(8, 4, 2, 0)
    with pytest.raises(ValueError, match=r"experts_per_token=5 must be an int in \[1, 4\]"):
        expert_capacity(8, 4, 5, 1.0)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_balance_loss_equals_the_reference_and_hugging_faces(score):
    torch.manual_seed(1)
    logits = torch.randn(20, 4, dtype=torch.float64)
    _, experts, scores = route(logits, 2, score=score)
    loss = load_balancing_loss(scores, experts, 4)
    torch.testing.assert_close(loss, reference_balance_loss(logits, 2, score).to(loss.dtype), rtol=1e-13, atol=0)
    if score == "softmax":
        transformers = pytest.importorskip("transformers")
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
        hf = load_balancing_loss_func((logits,), 4, 2)  # its softmax runs in float32: 1e-6 covers it
        torch.testing.assert_close(loss, hf.to(loss.dtype), rtol=1e-6, atol=0)
    uniform = load_balancing_loss(torch.full((4, 4), 0.25, dtype=torch.float64), torch.tensor([[0], [1], [2], [3]]), 4)
    assert uniform.item() == pytest.approx(1.0, abs=1e-15)  # its minimum, k=1: perfect balance


def test_the_bias_moves_against_the_load_and_steers_the_choice_only():
    bias = torch.zeros(4, dtype=torch.float64)
    update_bias(bias, torch.tensor([5.0, 1.0, 3.0, 3.0]), gamma=0.1)
    assert bias.tolist() == [-0.1, 0.1, 0.0, 0.0]
    logits = torch.tensor([[1.0, 0.9, -1.0, -2.0]], dtype=torch.float64)
    w0, e0, _ = route(logits, 1, score="sigmoid", normalize=False)
    w1, e1, _ = route(logits, 1, score="sigmoid", normalize=False, bias=torch.tensor([-0.5, 0.0, 0.0, 0.0]))
    assert e0.item() == 0 and e1.item() == 1  # the bias changed the choice
    assert w1.item() == pytest.approx(torch.sigmoid(torch.tensor(0.9)).item())  # not the weight


def test_update_expert_bias_reads_and_clears_each_layers_load():
    cfg = GPTConfig(**{**BASE, **CASES["deepseek"]})
    model = build_model(cfg, dtype=torch.float64)
    model(torch.randint(0, 64, (2, 8)))
    (layer,) = moe_layers(model)
    assert layer.load.sum().item() == 2 * 8 * 2  # N k choices counted
    load = layer.load.clone()
    update_expert_bias(model, 0.01)
    torch.testing.assert_close(layer.expert_bias, 0.01 * torch.sign(load.mean() - load), rtol=0, atol=0)
    assert layer.load.sum().item() == 0


@pytest.mark.parametrize("case", ["mixtral", "deepseek", "capacity-0.5-sigmoid"])
def test_flops_per_token_are_counted_exactly(case):
    cfg, layer = _layer(case)
    x = torch.randn(2, 8, cfg.d_model, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    kept = layer.kept / (16 * cfg.experts_per_token)
    assert counter.get_total_flops() == pytest.approx(16 * moe_flops_per_token(cfg, kept), rel=1e-12)


@pytest.mark.parametrize("case", ["mixtral", "deepseek"])
def test_param_counts_total_and_active(case):
    cfg = GPTConfig(**{**BASE, **CASES[case]})
    model = build_model(cfg)
    total, active = param_counts(cfg)
    biases = sum(m.expert_bias.numel() for m in moe_layers(model) if m.expert_bias is not None)
    assert total == count_params(cfg) == sum(p.numel() for p in model.parameters()) + biases  # the bias: a buffer
    unused = sum((cfg.n_experts - cfg.experts_per_token) * m.experts.c_gate[0].numel() * 3 for m in moe_layers(model))
    assert active == total - unused


def test_all_to_all_bytes_formula():
    rows = dispatched_rows(tokens=16, experts_per_token=2, dropped=3)
    assert rows == 29
    assert all_to_all_bytes(rows, 8, 4, 2, 8) == 4 * 29 * 8 * 8 + 2 * 8 * 4
    assert all_to_all_bytes(rows, 8, 4, 2, 8, backward=False) == 2 * 29 * 8 * 8 + 2 * 8 * 4


@pytest.mark.parametrize("field, value, message", [
    ("router_score", "relu", r"router_score='relu' is unknown; valid choices: \['softmax', 'sigmoid'\]"),
    ("capacity_factor", 0.0, r"capacity_factor=0.0 must be a finite number in \(0, inf\)"),
    ("norm_topk_prob", 1, "norm_topk_prob=1 must be True or False"),
    ("experts_per_token", 5, r"experts_per_token=5 must be an int in \[1, 4\]"),
    ("n_experts", -1, "n_experts=-1 must be an int >= 0"),
    ("mlp", "gelu", "n_experts=4 needs mlp='swiglu'"),
])
def test_bad_expert_fields_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**BASE, field: value})


def test_the_aux_loss_enters_the_training_loss_only():
    cfg = GPTConfig(**{**BASE, "aux_loss_coef": 0.5})
    model = build_model(cfg, dtype=torch.float64)
    idx = torch.randint(0, 64, (2, 8))
    loss = model(idx, idx)
    aux = sum(m.aux_loss for m in moe_layers(model))
    torch.testing.assert_close(loss, model.loss(model(idx), idx) + 0.5 * aux, rtol=1e-14, atol=0)
    model.eval()
    assert model(idx, idx).item() == pytest.approx(model.loss(model(idx), idx).item(), rel=1e-15)
    assert math.isfinite(aux.item()) and aux.item() > 0


def test_techniques_not_tried_on_experts_refuse_them_by_name():
    from labkit.model import check_gpt2_block

    llama_fields = ("norm", "mlp", "pos", "d_ff", "tie_embeddings", "bias", "n_kv_head")
    check_gpt2_block(GPTConfig(**{**BASE, "n_experts": 0, "experts_per_token": 0, "d_expert": None}), "a technique",
                     supports=llama_fields)  # the same block without experts passes
    with pytest.raises(ValueError, match="a technique implements GPT-2's block only so far; this model has n_experts=4"):
        check_gpt2_block(GPTConfig(**BASE), "a technique", supports=llama_fields)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full-recomputation"])
def test_the_aux_loss_gradient_reaches_the_router_at_the_losss_scale(recompute):
    """The aux loss's gradient joins at each layer (labkit.moe.layer._AuxLossGrad) at the scale the
    loss's backward is given (here 1/3), and a full recomputation neither loses nor repeats it nor
    counts the load twice: held to the gradient of (CE + coef Σ Switch's loss) / 3 written out with
    the reference's balance loss on a model without the aux loss (same weights)."""
    from labkit.checkpoint import apply_checkpointing

    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    models = []
    for coef in (0.5, 0.0):
        torch.manual_seed(0)
        models.append(build_model(GPTConfig(**{**BASE, "aux_loss_coef": coef}), dtype=torch.float64))
    model, plain = models
    if recompute:
        apply_checkpointing(model, "full")
    (model(idx, idx) / 3).backward()
    logits = []
    hooks = [m.router.register_forward_hook(lambda mod, args, out: logits.append(out)) for m in moe_layers(plain)]
    ce = plain(idx, idx)
    aux = sum(reference_balance_loss(lg, BASE["experts_per_token"]) for lg in logits)
    ((ce + 0.5 * aux) / 3).backward()
    for h in hooks:
        h.remove()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)
    assert [m.load.sum().item() for m in moe_layers(model)] == [2 * 8 * 2] * len(logits)  # N k, once
    with pytest.raises(ValueError, match="impl='torch' recomputes a full segment"):
        apply_checkpointing(model, "full", impl="torch")
