"""Bad input to the core says what is wrong, where it is given: the argument, the value and what
would be valid. A bool is not an int, a string is not a bool or a number, NaN is not a number."""

import dataclasses
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import labkit
from labkit import collectives, validate
from labkit.data import batches, get_batch, get_padded_batch, load_corpus
from labkit.dist import launch
from labkit.hardware import mfu
from labkit.memory import activation_bytes, model_state_bytes, plot_breakdown, plot_timeline, train_step
from labkit.model import GPTConfig, build_model, count_params, get_preset, training_flops
from labkit.precision import MasterWeightOptimizer, make_optimizer, model_dtype

# Its module fixtures launch ranks once: every test of the file on one xdist worker, or each
# worker that picked one up would launch them again.
pytestmark = pytest.mark.xdist_group("dist:input_errors")

CFG = get_preset("tiny", n_layer=1)
# the expert fields may be 0 (a dense model) and are bounded by each other: tests/test_moe.py
EXPERT_FIELDS = ("n_experts", "experts_per_token", "n_shared_experts", "first_dense_layers", "moe_every")
# and MLA's are 0 without MLA: tests/test_mla.py
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
INT_FIELDS = [f.name for f in dataclasses.fields(GPTConfig)
              if f.type in (int, "int") and f.name not in EXPERT_FIELDS + MLA_FIELDS]


# --- labkit.validate itself --------------------------------------------------------------------

def test_an_argument_error_is_both_a_value_error_and_a_type_error():
    with pytest.raises(ValueError):
        validate.check_int("n", "3")
    with pytest.raises(TypeError):
        validate.check_int("n", "3")


@pytest.mark.parametrize("check, value, message", [
    (lambda v: validate.check_int("n", v, 1), True, "n=True must be an int >= 1"),
    (lambda v: validate.check_int("n", v, 0, 7), 8, r"n=8 must be an int in \[0, 7\]"),
    (lambda v: validate.check_bool("flag", v), "no", "flag='no' must be True or False"),
    (lambda v: validate.check_bool("flag", v), 1, "flag=1 must be True or False"),
    (lambda v: validate.check_float("p", v, 0.0, below=1.0), "0.1", r"p='0.1' must be a finite number in \[0, 1\)"),
    (lambda v: validate.check_float("p", v, 0.0, below=1.0), 1.0, r"p=1.0 must be a finite number in \[0, 1\)"),
    (lambda v: validate.check_float("x", v), math.nan, r"x=nan must be a finite number in \(-inf, inf\)"),
    (lambda v: validate.check_float("x", v), True, "x=True must be a finite number"),
    (lambda v: validate.check_positive("t", v), 0, r"t=0 must be a finite number in \(0, inf\)"),
    (lambda v: validate.check_positive("t", v), math.inf, "t=inf must be a finite number"),
    (lambda v: validate.check_choice("mode", v, ["a", "b"]), "c", r"mode='c' is unknown; valid choices: \['a', 'b'\]"),
])
def test_each_check_refuses_naming_the_argument_the_value_and_what_is_valid(check, value, message):
    with pytest.raises(ValueError, match=message):
        check(value)


def test_the_checks_pass_good_values_through():
    assert validate.check_int("n", 3, 1) == 3
    assert validate.check_bool("flag", False) is False
    assert validate.check_float("p", 0, 0.0, below=1.0) == 0.0 and validate.check_positive("t", 2) == 2.0
    assert validate.check_float("p", torch.tensor(0.5).item(), 0.0, 1.0) == 0.5


# --- the model's configuration: checked when it is built, not at the first forward --------------

@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("bad", [True, 0, -4, 4.0, "4"])
def test_every_int_field_of_gptconfig_refuses_bools_floats_strings_and_non_positive(field, bad):
    with pytest.raises(ValueError, match=rf"{field}={bad!r} must be an int >= 1"):
        GPTConfig(**{field: bad})


@pytest.mark.parametrize("bad", ["0.1", math.nan, 1.0, -0.1, True, None])
def test_dropout_is_a_finite_number_in_0_1_checked_at_construction(bad):
    with pytest.raises(ValueError, match=rf"dropout={bad!r} must be a finite number in \[0, 1\)"):
        GPTConfig(dropout=bad)
    with pytest.raises(ValueError, match="dropout="):
        get_preset("tiny", dropout=bad)


@pytest.mark.parametrize("call, message", [
    (lambda: training_flops(CFG, True), "global_batch=True must be an int >= 1"),
    (lambda: training_flops(CFG, 8, recompute="no"), "recompute='no' must be True or False"),
    (lambda: count_params("tiny"), "cfg='tiny' must be a GPTConfig"),
    (lambda: build_model(CFG, dtype=torch.int64), "dtype=torch.int64 must be None or a floating"),
    (lambda: get_preset(7), "preset=7 is unknown"),
])
def test_the_model_functions_refuse_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- token ids and targets: a clear error, not torch's IndexError or a silent nan -----------------

@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


@pytest.mark.parametrize("bad, shown", [(CFG.vocab_size, CFG.vocab_size), (-1, -1)])
def test_a_token_id_outside_the_vocabulary_is_refused(model, bad, shown):
    idx = torch.zeros(2, 8, dtype=torch.long)
    idx[1, 3] = bad
    with pytest.raises(ValueError, match=rf"token id {shown} is outside \[0, vocab_size={CFG.vocab_size}\)"):
        model(idx)
    idx[1, 3] = CFG.vocab_size - 1  # the largest valid id passes
    assert model(idx).shape == (2, 8, CFG.vocab_size)


@pytest.mark.parametrize("bad", [CFG.vocab_size, -1, -99])
def test_a_target_outside_the_vocabulary_names_the_minus_100_convention(model, bad):
    x, y = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    y[0, 5] = bad
    with pytest.raises(ValueError, match=rf"target {bad} is outside \[0, vocab_size=256\); mark positions "
                                         "that have no target with -100"):
        model(x, y)
    y[0, 5] = -100  # the convention: ignored, and the loss is the mean over the other 15 targets
    y[0, :5] = -100
    assert torch.isfinite(model(x, y))


def test_a_batch_whose_every_target_is_ignored_is_refused_not_a_silent_nan(model):
    # torch's mean over no tokens is 0/0 = nan: refused with a reason (labkit.data never makes one)
    x, y = torch.zeros(2, 8, dtype=torch.long), torch.full((2, 8), -100)
    assert torch.isnan(torch.nn.functional.cross_entropy(model(x).view(16, -1), y.view(16)))
    with pytest.raises(ValueError, match="every target is -100 .* the mean loss over no tokens is undefined"):
        model(x, y)


@pytest.mark.parametrize("idx, targets, message", [
    (torch.zeros(8, dtype=torch.long), None, r"idx=a 1-D torch.int64 tensor must be a 2-D int64 tensor"),
    (torch.zeros(2, 8), None, r"idx=a 2-D torch.float32 tensor must be a 2-D int64 tensor"),
    (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8), r"targets=a 2-D torch.float32 tensor"),
    (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long),
     r"targets of shape \(2, 7\) must match the logits' \(B, T\) = \(2, 8\)"),
])
def test_wrong_dtypes_and_shapes_of_ids_and_targets_are_named(model, idx, targets, message):
    with pytest.raises(ValueError, match=message):
        model(idx, targets)


def test_fake_and_meta_tensors_skip_the_value_checks_they_cannot_make():
    with FakeTensorMode():  # Lab 1's 7B step: nothing allocated, no values to compare
        logits = build_model(CFG)(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, CFG.vocab_size)
    meta = build_model(CFG, device="meta")
    assert meta(torch.zeros(2, 8, dtype=torch.long, device="meta")).is_meta


# --- device, data ------------------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda: labkit.seed_everything(True), "seed=True must be an int"),
    (lambda: labkit.seed_everything(1.5), "seed=1.5 must be an int"),
    (lambda: labkit.seed_everything(-1), "seed=-1 must be an int"),
    (lambda: labkit.setup(0, verbose="no"), "verbose='no' must be True or False"),
    (lambda: labkit.pick_device(0), "prefer=0 is unknown"),
    (lambda: get_batch(load_corpus(), True, 8), "batch_size=True must be an int >= 1"),
    (lambda: get_batch(load_corpus(), 2, 2.5), "seq_len=2.5 must be an int"),
    (lambda: get_batch(torch.rand(100), 2, 8), "tokens=a 1-D torch.float32 tensor must be a 1-D integer"),
    (lambda: next(batches(2, 8, seed=True)), "seed=True must be an int"),
    (lambda: next(batches(2, -8)), "seq_len=-8 must be an int"),
    (lambda: get_padded_batch(load_corpus(), [3.7, 2]), r"lengths\[0\]=3.7 must be an int >= 1"),
    (lambda: get_padded_batch(load_corpus(), [4, True]), r"lengths\[1\]=True must be an int >= 1"),
    (lambda: get_padded_batch(load_corpus(), [4, 0]), r"lengths\[1\]=0 must be an int >= 1"),
    (lambda: get_padded_batch(load_corpus(), [4], pad_id=-1), "pad_id=-1 must be an int >= 0"),
])
def test_device_and_data_refuse_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- dist, collectives -------------------------------------------------------------------------

def _never_run(rank, world_size):  # launch refuses before any process starts
    raise AssertionError("launch started a rank despite a bad argument")


@pytest.mark.parametrize("kwargs, message", [
    ({"timeout_s": -1}, r"timeout_s=-1 must be a finite number in \(0, inf\)"),
    ({"timeout_s": 0}, "timeout_s=0 must be"),
    ({"timeout_s": "30"}, "timeout_s='30' must be"),
    ({"join_timeout_s": math.nan}, "join_timeout_s=nan must be"),
    ({"backend": "mpi"}, "backend='mpi' is unknown"),
])
def test_launch_refuses_bad_timeouts_before_starting_a_rank(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch(_never_run, 2, **kwargs)
    with pytest.raises(ValueError, match="world_size=True must be an int >= 1"):
        launch(_never_run, True)


@pytest.mark.parametrize("call, message", [
    (lambda: collectives.all_gather_flat(torch.ones(2), True), "world_size=True must be an int >= 1"),
    (lambda: collectives.reduce_scatter_flat(torch.ones(4), 0), "world_size=0 must be an int >= 1"),
    (lambda: collectives.all_reduce_mean_(torch.ones(4), 2.0), "world_size=2.0 must be an int >= 1"),
    (lambda: collectives.all_gather_flat(torch.ones(2), 2, async_op="no"), "async_op='no' must be True or False"),
])
def test_collectives_refuse_a_bad_world_size_before_any_communication(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- precision, memory, hardware ---------------------------------------------------------------

def _params():
    return [torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))]


@pytest.mark.parametrize("call, message", [
    (lambda: make_optimizer(_params(), "fp32", "adamw", lr=-1e-3), r"lr=-0.001 must be a finite number in \[0, inf\)"),
    (lambda: make_optimizer(_params(), "fp32", "adamw", lr="1e-3"), "lr='1e-3' must be a finite number"),
    (lambda: MasterWeightOptimizer(_params(), fp32_grads="no"), "fp32_grads='no' must be True or False"),
    (lambda: model_dtype("mixed", half=torch.float32), "half=torch.float32 must be torch.bfloat16 or"),
    (lambda: model_state_bytes(True), "n_params=True must be an int >= 0"),
    (lambda: model_state_bytes(10, step_on_device="no"), "step_on_device='no' must be True or False"),
    (lambda: activation_bytes(CFG, True), "batch_size=True must be an int >= 1"),
    (lambda: activation_bytes(CFG, 2, training="no"), "training='no' must be True or False"),
    (lambda: activation_bytes(CFG, 2, dtype_bytes=True), r"dtype_bytes=True is unknown; valid choices: \[2, 4\]"),
    (lambda: train_step(torch.nn.Linear(2, 2), None, (torch.ones(1, 2),), zero_grad="no"), "zero_grad='no'"),
    (lambda: plot_timeline(None, unit=0), r"unit=0 must be a finite number in \(0, inf\)"),
    (lambda: plot_breakdown({"a": 1}, {"b": 1}), r"measured=\['b'\] must have every key of predicted=\['a'\]"),
    (lambda: mfu(1e15, 1.0, True, "a100"), "n_gpus=True must be an int >= 1"),
    (lambda: mfu(1e15, math.nan, 8, "a100"), "step_time_s=nan must be a finite number"),
    (lambda: mfu(-1.0, 1.0, 8, "a100"), r"flops_per_step=-1.0 must be a finite number in \[0, inf\)"),
])
def test_precision_memory_and_hardware_refuse_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_master_weight_state_saved_for_another_model_is_refused_not_broadcast():
    small = MasterWeightOptimizer([torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))])
    big = MasterWeightOptimizer([torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match=r"state\['master'\] holds 1 tensors of shapes \[\(3,\)\]"):
        big.load_state_dict(small.state_dict())  # copy_ would broadcast (3,) into (4, 3)
    assert torch.equal(big.master[0], torch.zeros(4, 3))  # nothing was changed


@pytest.mark.parametrize("call, message", [
    (lambda: train_step(torch.nn.Linear(2, 2), None, torch.ones(2, 2)), "batch=Tensor must be a tuple"),
    (lambda: labkit.data.encode(b"bytes"), "text=bytes must be a str"),
])
def test_a_batch_or_text_of_the_wrong_kind_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("call, message", [
    (lambda: labkit.model.GPT("tiny"), "cfg='tiny' must be a GPTConfig"),
    (lambda: labkit.book.glue("x", 1, display="no"), "display='no' must be True or False"),
    (lambda: labkit.book.glue(3, 1), "name=3 must be a non-empty str"),
    (lambda: labkit.book.glue("x_zh", 1), "name='x_zh' must not end in '_zh': pass the Chinese as zh="),
    (lambda: labkit.book.chinese_text("phase", "sideways"), "word='sideways' is no phase"),
    (lambda: labkit.book.chinese_text("colour", "red"), "kind='colour' must be one of"),
    (lambda: labkit.book.overflow_text("params", 1.0, 2.0, "fr"), "language='fr' must be 'en' or 'zh'"),
])
def test_the_model_class_and_glue_name_a_bad_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
