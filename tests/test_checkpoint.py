"""labkit.checkpoint: the mechanism, the policies and the planner against references.

References that share no code with labkit's mechanism: the model without checkpointing,
``torch.utils.checkpoint`` (non-reentrant), FlopCounterMode's count of the blocks' own forward,
and a brute-force search over every plan of a four-block model.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.checkpoint import (
    Plan, apply_checkpointing, checkpoint_activation_bytes, checkpoint_scratch, checkpoint_torch,
    make_plan, min_peak_plan, plan_for_budget, recompute_flops, remove_checkpointing,
)
from labkit.model import GPTConfig, build_model

SMALL = GPTConfig(n_layer=4, n_head=4, d_model=64, seq_len=32, vocab_size=64, dropout=0.1)
POLICIES = [("none", None), ("full", None), ("every_k", 2), ("sqrt", None), ("selective", None)]


def _batch(cfg, batch_size=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g))


def _model(cfg=SMALL, training=True):
    torch.manual_seed(0)
    return build_model(cfg).train(training)


def _grads(model, batch, seed=1):
    """Loss and parameter gradients of one step, the dropout RNG seeded the same for every model."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b):
    # exact: recomputation runs the same kernels on the same inputs, with the same dropout masks
    assert torch.equal(a[0], b[0])
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


# --- gradients --------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("policy, k", POLICIES + [("budget", None)])
def test_gradients_equal_no_checkpointing_and_torch(policy, k, training):
    batch, plain = _batch(SMALL), _model(training=training)
    reference = _grads(plain, batch)
    budget = dict(budget=checkpoint_activation_bytes(SMALL, "sqrt", 2).peak, batch_size=2) if policy == "budget" else {}
    results = {}
    for impl in ("scratch", "torch"):
        model = copy.deepcopy(plain)
        plan = apply_checkpointing(model, policy, k=k, impl=impl, **budget)
        results[impl] = _grads(model, batch)
        _assert_same(results[impl], reference)
    _assert_same(results["scratch"], results["torch"])
    if policy != "none":
        assert "F" in str(plan) or "S" in str(plan)  # something was checkpointed


def test_dropout_masks_need_the_rng_state():
    """Without restoring the RNG state the recomputed masks differ, and so do the gradients."""
    block = _model().blocks[0]
    x = torch.randn(2, SMALL.seq_len, SMALL.d_model, requires_grad=True)

    def grads(**kw):
        torch.manual_seed(3)
        out = checkpoint_scratch(block, x, **kw)
        return torch.autograd.grad(out.square().sum(), [x, *block.parameters()])

    torch.manual_seed(3)
    plain = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    for a, b in zip(grads(), plain):
        assert torch.equal(a, b)  # exact: same kernels, same masks
    assert not all(torch.equal(a, b) for a, b in zip(grads(preserve_rng_state=False), plain))


def test_inputs_without_grad_keyword_arguments_and_autograd_grad():
    """Parameters get gradients even when no input requires grad; kwargs (tensor or not) pass through."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)  # requires no grad: a reentrant checkpoint would drop the weight's gradient
    scale = torch.tensor(1.5, requires_grad=True)

    def fn(inp, *, scale, power=2):
        return (lin(inp) * scale) ** power

    want = torch.autograd.grad(fn(x, scale=scale, power=3).sum(), [lin.weight, lin.bias, scale])
    calls = {"scratch": lambda: checkpoint_scratch(fn, x, scale=scale, power=3, params=list(lin.parameters())),
             "torch": lambda: checkpoint_torch(fn, x, scale=scale, power=3)}
    for impl, call in calls.items():
        got = torch.autograd.grad(call().sum(), [lin.weight, lin.bias, scale])
        for a, b in zip(got, want):
            assert torch.equal(a, b), impl  # exact: the same ops recomputed
    checkpoint_scratch(lin, x).sum().backward()  # a module's own parameters are found for it
    assert torch.equal(lin.weight.grad, torch.autograd.grad(lin(x).sum(), lin.weight)[0])


@pytest.mark.parametrize("make_fn", ["closure", "partial"])
def test_parameters_read_but_not_passed_get_their_gradients(make_fn):
    """A closure's weight and a functools.partial of a module's forward: nobody passes their
    parameters in, yet backward gives them the gradient torch.utils.checkpoint gives."""
    torch.manual_seed(0)
    lin, w = torch.nn.Linear(8, 8), torch.randn(8, 8, requires_grad=True)
    fn = (lambda x: torch.tanh(x @ w)) if make_fn == "closure" else functools.partial(lin.forward)
    leaves = [w] if make_fn == "closure" else list(lin.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    grads = {}
    for impl, call in (("scratch", checkpoint_scratch), ("torch", checkpoint_torch)):
        for t in leaves + [x]:
            t.grad = None
        call(fn, x).square().sum().backward()
        grads[impl] = [t.grad.clone() for t in leaves + [x]]  # a None .grad fails right here
    for a, b in zip(grads["scratch"], grads["torch"]):
        assert torch.equal(a, b)  # exact: the same ops recomputed in the same order


def test_no_grad_is_a_plain_call_and_nothing_is_saved():
    block = _model(training=False).blocks[0]
    x = torch.randn(1, SMALL.seq_len, SMALL.d_model)
    with torch.no_grad():
        out = checkpoint_scratch(block, x)
    assert out.grad_fn is None and torch.equal(out, block(x).detach())


def test_apply_keeps_parameter_names_and_remove_restores_the_forward():
    model = _model()
    names = list(model.state_dict())
    apply_checkpointing(model, "sqrt")
    assert list(model.state_dict()) == names
    assert "forward" in vars(model.blocks[0]) and "forward" in vars(model.blocks[1])
    apply_checkpointing(model, "selective")  # reapplying replaces the plan
    assert "forward" not in vars(model.blocks[1]) and "forward" in vars(model.blocks[1].attn.core)
    remove_checkpointing(model)
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("policy", ["sqrt", "selective"])
def test_a_deep_copy_of_a_checkpointed_model_runs_its_own_modules(policy):
    model = _model()  # training, dropout on
    apply_checkpointing(model, policy)
    twin, batch = copy.deepcopy(model).eval(), _batch(SMALL)
    loss = twin(*batch)
    assert torch.equal(loss, twin(*batch))  # in eval no module draws a mask, had it kept the original's
    loss.backward()
    assert all(p.grad is not None for p in twin.parameters()) and all(p.grad is None for p in model.parameters())


# --- plans and bad input ----------------------------------------------------------------------

def test_plans_of_the_named_policies():
    assert str(make_plan("full", 4)) == "[F] [F] [F] [F]"
    assert str(make_plan("every_k", 6, k=3)) == "N N [F] N N [F]"
    assert str(make_plan("sqrt", 9)) == "[FFF] [FFF] [FFF]"
    assert str(make_plan("sqrt", 5)) == "[FFF] [FF]"  # ceil(sqrt 5) = 3 blocks a segment
    assert str(make_plan("selective", 2)) == "S S"
    assert make_plan("every_k", 4, k=1) == make_plan("full", 4)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(policy="half"), r"policy='half'.*valid choices: \['none', 'full', 'every_k', 'sqrt', 'selective', 'budget'\]"),
    (dict(policy="every_k", k=0), r"k=0 must be an int in \[1, n_layer=4\]"),
    (dict(policy="every_k", k=-2), r"k=-2 must be an int in \[1, n_layer=4\]"),
    (dict(policy="every_k"), r"k=None must be an int in \[1, n_layer=4\]"),
    (dict(policy="every_k", k=5), r"k=5 must be an int in \[1, n_layer=4\].*would checkpoint no block"),
    (dict(policy="every_k", k=True), r"k=True must be an int"),
    (dict(policy="full", k=2), r"k=2 is only used by policy='every_k'"),
    (dict(policy="full", budget=10**6), r"budget=1000000 is only used by policy='budget'"),
    (dict(policy="budget"), r"policy='budget' needs budget= and batch_size="),
    (dict(policy="budget", budget=-5, batch_size=2), r"budget=-5 must be an int >= 1"),
    (dict(policy="budget", budget=10**6, batch_size=True), r"batch_size=True must be an int >= 1"),
    (dict(policy="full", impl="jax"), r"impl='jax' is unknown; valid choices: \['scratch', 'torch'\]"),
])
def test_bad_input_names_argument_value_and_choices(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        apply_checkpointing(_model(), **kwargs)


def test_plans_refuse_bools_where_ints_are_expected():
    with pytest.raises(ValueError, match=r"n_layer=True must be an int >= 1"):
        make_plan("full", True)
    with pytest.raises(ValueError, match=r"segment \('full', True\)"):
        Plan((("full", True),))


def test_a_model_without_blocks_is_refused_with_what_it_needs():
    with pytest.raises(TypeError, match=r"needs a model whose .blocks is an nn.ModuleList.*Linear with .blocks=missing"):
        apply_checkpointing(torch.nn.Linear(2, 2), "full")
    blocks = torch.nn.Module()
    blocks.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # blocks without an attention core
    with pytest.raises(TypeError, match=r"selective checkpointing recomputes block.attn.core, which block 0 \(Linear\)"):
        apply_checkpointing(blocks, "selective")


def test_a_budget_below_the_smallest_peak_says_what_can_be_reached():
    smallest, _ = min_peak_plan(SMALL, 2)
    with pytest.raises(ValueError, match=rf"budget={smallest - 1:,} bytes is below the smallest peak "
                                         rf"that can be reached, {smallest:,} bytes"):
        apply_checkpointing(_model(), "budget", budget=smallest - 1, batch_size=2)
    assert checkpoint_activation_bytes(SMALL, plan_for_budget(SMALL, smallest, 2), 2).peak == smallest


# --- recomputation counted exactly ------------------------------------------------------------

def _step_flops(model, batch):
    counter = FlopCounterMode(display=False)
    with counter:
        model(*batch).backward()
    return counter.get_total_flops(), counter.get_flop_counts()


def test_recomputed_flops_are_counted_exactly():
    batch, plain = _batch(SMALL), _model()
    base, counts = _step_flops(copy.deepcopy(plain), batch)
    counter = FlopCounterMode(display=False)  # the blocks' own forward, counted apart from any step
    with counter, torch.no_grad():
        plain(batch[0])
    fwd = counter.get_flop_counts()
    blocks = sum(fwd[f"GPT.blocks.{i}"][op] for i in range(SMALL.n_layer) for op in fwd[f"GPT.blocks.{i}"])
    cores = sum(fwd[f"GPT.blocks.{i}.attn.core"][op] for i in range(SMALL.n_layer) for op in fwd[f"GPT.blocks.{i}.attn.core"])
    expected = {"none": 0, "full": blocks, "sqrt": blocks, "every_k": blocks // 2, "selective": cores}
    for policy, k in POLICIES:
        for impl in ("scratch", "torch"):
            model = copy.deepcopy(plain)
            apply_checkpointing(model, policy, k=k, impl=impl)
            extra = _step_flops(model, batch)[0] - base
            if impl == "scratch":
                assert extra == expected[policy] == recompute_flops(SMALL, policy, 2, k=k), policy
            elif policy == "selective":  # torch stops recomputing once every saved tensor is back:
                assert extra == cores // 2  # the core's last matmul, att @ v, saves nothing for backward
            else:
                assert extra == expected[policy], (policy, impl)


# --- the budgeted plan ------------------------------------------------------------------------

def _all_plans(n_layer):
    """Every plan: each way to cut n_layer blocks into segments, each segment with each mode."""
    for cuts in itertools.product([False, True], repeat=n_layer - 1):
        lengths, run = [], 1
        for cut in cuts:
            if cut:
                lengths.append(run)
                run = 0
            run += 1
        lengths.append(run)
        choices = [["full"] if n > 1 else ["none", "selective", "full"] for n in lengths]
        for modes in itertools.product(*choices):
            yield Plan(tuple(zip(modes, lengths)))


def test_the_planner_is_optimal_against_brute_force():
    plans = list(_all_plans(SMALL.n_layer))
    assert len(plans) == 81 + 3 * 9 + 1 + 2 * 3 + 1  # lengths 1111, 211 (x3), 22, 31 (x2), 4
    peaks = {p: checkpoint_activation_bytes(SMALL, p, 2).peak for p in plans}
    assert min_peak_plan(SMALL, 2)[0] == min(peaks.values())
    for budget in sorted(set(peaks.values()))[::7]:
        fits = [recompute_flops(SMALL, p, 2) for p in plans if peaks[p] <= budget]
        plan = plan_for_budget(SMALL, budget, 2)
        assert peaks[plan] <= budget and recompute_flops(SMALL, plan, 2) == min(fits)
