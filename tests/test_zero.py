"""labkit.zero without processes: shard arithmetic, volumes, refusals, the worked example."""

import pytest
import torch

from labkit.memory import model_state_bytes
from labkit.collectives import buckets_by_numel
from labkit.data_parallel import DataParallelBucketed
from labkit.zero import (FlatLayout, FullyShardedModule, ShardedGradOptimizer,
                         ShardedOptimizer, analytic_comm_volume, check_elementwise_optimizer, comm_volume,
                         offload_savings, padded_numel, shard_numel, shard_range, zero_model_state_bytes)
from labkit.zero.flat import param_slice


@pytest.mark.parametrize("numel,world_size", [(10, 4), (3, 4), (12, 3), (0, 2), (1, 1)])
def test_shard_ranges_tile_the_tensor_with_padding_at_the_end(numel, world_size):
    s = shard_numel(numel, world_size)
    assert s * world_size == padded_numel(numel, world_size) >= numel
    assert padded_numel(numel, world_size) - numel < world_size  # never a whole extra shard
    ranges = [shard_range(numel, world_size, r) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c and b - a <= s  # contiguous, none larger than a shard


def test_a_world_larger_than_the_tensor_leaves_ranks_with_padding_only():
    assert [shard_range(3, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]


@pytest.mark.parametrize("call,name", [
    (lambda: shard_range(10, 4, 4), "rank=4"),
    (lambda: shard_range(10, 0, 0), "world_size=0"),
    (lambda: shard_numel(-1, 2), "numel=-1"),
    (lambda: analytic_comm_volume(10, 4), "stage=4"),
    (lambda: comm_volume({"all_to_all": 3}), "all_to_all"),
    (lambda: zero_model_state_bytes(10, 0, 1), r"world_size=0 must be an int >= 1"),
    (lambda: zero_model_state_bytes(10, 2, 4), r"stage=4 is unknown; valid choices: \[0, 1, 2, 3\]"),
    (lambda: zero_model_state_bytes(10, 2, True), r"stage=True is unknown; valid choices"),
    (lambda: shard_numel(True, 2), "numel=True"),
])
def test_bad_arguments_raise_value_errors_that_name_them(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_param_slice_cuts_each_tensor_at_the_rank_boundary():
    # tensors of 5 and 7 elements at offsets 0 and 5; rank range [4, 8)
    assert param_slice(0, 5, 4, 8) == (4, 5)
    assert param_slice(5, 7, 4, 8) == (0, 3)
    assert param_slice(5, 7, 0, 4) == (0, 0)  # no overlap: an empty slice


def test_flat_layout_round_trips_and_pads_with_zeros():
    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([7.0]), None]
    layout = FlatLayout.of(["a", "b", "c"], [tensors[0], tensors[1], torch.zeros(2)])
    flat = layout.flatten(tensors, world_size=4)  # 9 elements -> 12
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7, 0, 0, 0, 0, 0]
    views = layout.views(flat)
    assert torch.equal(views[0], tensors[0]) and views[2].shape == (2,)
    views[1].fill_(9.0)  # views, not copies
    assert flat[6] == 9.0
    with pytest.raises(ValueError, match="share dtype and device.*torch.float16"):
        FlatLayout.of(["a", "b"], [torch.zeros(2), torch.zeros(2, dtype=torch.float16)])  # no silent cast


def test_communication_volumes_follow_the_paper():
    psi = 1_000
    assert analytic_comm_volume(psi, 0) == analytic_comm_volume(psi, 1) == analytic_comm_volume(psi, 2) == 2 * psi
    assert analytic_comm_volume(psi, 3) == 3 * psi  # 1.5x data parallelism
    # two groups of 999 and 1 elements over 4 ranks pad to 1000 and 4
    assert analytic_comm_volume(1_000, 3, 4, group_numels=[999, 1]) == 3 * 1_004
    assert comm_volume({"all_reduce": 10, "reduce_scatter": 3, "all_gather": 4, "broadcast": 1}) == 28


def test_zero_stages_shard_what_they_say():
    full = model_state_bytes(64, "mixed", "adam")
    assert zero_model_state_bytes(64, 4, 0).total == full.total
    assert zero_model_state_bytes(64, 4, 1).as_dict() == {"params": 128, "grads": 128, "optimizer": 192, "total": 448}
    assert zero_model_state_bytes(64, 4, 3).total == full.total // 4


def test_zero_worked_example_of_the_paper():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, N_d = 64, mixed-precision Adam
    gb = {stage: zero_model_state_bytes(7_500_000_000, 64, stage).total / 1e9 for stage in range(4)}
    assert round(gb[0]) == 120 and round(gb[1], 1) == 31.4 and round(gb[2], 1) == 16.6 and round(gb[3], 2) == 1.88


def test_offload_leaves_only_the_16_bit_parameters_on_the_gpu():
    s = offload_savings(7_500_000_000, world_size=64)
    assert s.gpu_bytes_with + s.cpu_bytes == s.gpu_bytes_without
    assert s.cpu_bytes == (2 + 12) * shard_numel(7_500_000_000, 64)  # fp16 gradients; fp32 master, m, v
    assert s.pcie_bytes_per_step == 2 * 2 * shard_numel(7_500_000_000, 64)  # fp16 gradients down, parameters up
    # Ren et al. 2021: a 13B model trains on one 32 GB V100; its 16-bit parameters are 26 GB
    assert offload_savings(13_000_000_000, world_size=1).gpu_bytes_with == 26e9
    with pytest.raises(ValueError, match="precision='fp8'"):
        offload_savings(10, precision="fp8")


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop])
def test_elementwise_optimizers_are_accepted_and_do_update_a_cut_parameter_as_a_whole(cls):
    check_elementwise_optimizer(cls, {"lr": 1e-2})  # raises if refused
    # what acceptance promises, checked here without the probe's code: three steps on a (4, 5)
    # parameter equal three steps on its flat pieces of 7 and 13 elements, the way shards cut it
    gen = torch.Generator().manual_seed(1)
    w, grads = torch.randn(4, 5, generator=gen), [torch.randn(4, 5, generator=gen) for _ in range(3)]
    whole = torch.nn.Parameter(w.clone())
    pieces = [torch.nn.Parameter(w.reshape(-1)[:7].clone()), torch.nn.Parameter(w.reshape(-1)[7:].clone())]
    opt_whole, opt_pieces = cls([whole], lr=1e-2), cls(pieces, lr=1e-2)
    for g in grads:
        whole.grad = g.clone()
        pieces[0].grad, pieces[1].grad = g.reshape(-1)[:7].clone(), g.reshape(-1)[7:].clone()
        opt_whole.step()
        opt_pieces.step()
    # elementwise: the same operations on the same numbers; only a fused multi-tensor kernel
    # could round differently, by an ulp of values ~1
    torch.testing.assert_close(torch.cat([p.detach() for p in pieces]), whole.detach().reshape(-1),
                               rtol=2**-23, atol=1e-7)
    assert not torch.equal(whole.detach(), w)  # the steps moved it


def test_lbfgs_is_refused_before_any_communication():
    # no process group exists here: the refusal must come first
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="optimizer_cls=LBFGS cannot be sharded.*closure"):
        ShardedOptimizer(params, torch.optim.LBFGS, lr=1.0)


def test_optimizers_with_factored_state_are_refused():
    with pytest.raises(ValueError, match="optimizer_cls=Adafactor.*row_var of shape"):
        check_elementwise_optimizer(torch.optim.Adafactor, {"lr": 1e-2})
    with pytest.raises(TypeError, match="optimizer_cls=Linear must be a torch.optim.Optimizer"):
        check_elementwise_optimizer(torch.nn.Linear, {})


def test_bad_wrapper_arguments_are_refused_before_any_communication():
    # no process group exists here: each refusal must come before the first collective
    with pytest.raises(ValueError, match="bucket_numel=0"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(3))], torch.optim.SGD, bucket_numel=0, lr=1.0)
    with pytest.raises(ValueError, match="bucket_numel=True"):
        DataParallelBucketed(torch.nn.Linear(2, 2), bucket_numel=True)
    with pytest.raises(ValueError, match=r"compute_dtype=torch.int8 must be one of"):
        FullyShardedModule(torch.nn.Linear(2, 2), compute_dtype=torch.int8)
    for make in (lambda: ShardedGradOptimizer([torch.nn.Parameter(torch.zeros(3))], torch.optim.SGD,
                                              init_sync="trust", lr=1.0),
                 lambda: FullyShardedModule(torch.nn.Linear(2, 2), init_sync="trust")):
        with pytest.raises(ValueError, match=r"init_sync='trust' is unknown; valid choices: \['broadcast', 'check'\]"):
            make()


def test_buckets_hold_at_most_bucket_numel_elements_in_order():
    sizes = [5, 3, 9, 2, 2, 20, 1]
    buckets = buckets_by_numel(sizes, lambda n: n, 10)
    assert [n for b in buckets for n in b] == sizes  # every item once, in order
    assert buckets == [[5, 3], [9], [2, 2], [20], [1]]  # 20 > 10 gets a bucket of its own
    assert all(sum(b) <= 10 for b in buckets if len(b) > 1)
    assert buckets_by_numel(sizes, lambda n: n, None) == [sizes]  # None: one bucket


def test_adam_agreement_judges_against_the_floor_of_the_reference_pair():
    from labkit.runs.zero import adam_agreement

    gen = torch.Generator().manual_seed(0)
    ref = {"w": torch.randn(10_000, generator=gen) * 0.02, "b": torch.zeros(10)}

    def like_roundoff(scale_bulk, outliers):  # the bulk off by ~scale_bulk, a few elements further
        out = {k: v + scale_bulk * torch.randn(v.shape, generator=gen) for k, v in ref.items()}
        out["w"][:5] += outliers
        return out

    other = like_roundoff(1e-8, 5e-5)  # the reference in another order: the run's own round-off
    ours = like_roundoff(1e-8, 5e-5)  # a scheme off by as much: it passes
    agree = adam_agreement(ours, ref, 3e-3, other)
    assert agree["ok"] and agree["names_match"] and agree["max"] == pytest.approx(5e-5, rel=0.01)
    assert agree["floor_max"] == pytest.approx(5e-5, rel=0.01)
    shifted = {"w": ref["w"] + 2e-6, "b": ref["b"]}  # every element of a tensor off: a wrong update
    assert not adam_agreement(shifted, ref, 3e-3, other)["ok"]
    far = {k: v.clone() for k, v in ours.items()}
    far["w"][:50] += 1e-4  # 0.5% of the elements off: more than the 0.1% the bulk leaves out
    assert not adam_agreement(far, ref, 3e-3, other)["ok"]
    outliers = like_roundoff(1e-8, 1e-3)  # 5 elements far off, as round-off gradients can move them
    assert adam_agreement(outliers, ref, 3e-3, other)["ok"]  # reported, not judged: "max" says it
    assert adam_agreement(outliers, ref, 3e-3, other)["max"] == pytest.approx(1e-3, rel=0.01)
    assert adam_agreement(ours, ref, 3e-3, [other, like_roundoff(1e-8, 1e-4)])["floor_max"] > 9e-5  # lists
    assert not adam_agreement({"w": ref["w"]}, ref, 3e-3, other)["names_match"]
