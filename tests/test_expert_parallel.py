"""Expert parallelism on gloo ranks against one process (code shared: the model only).

One launch per world size serves every check: a plain training loop over ``parallelize_gpt``
with experts sharded over "ep" (or replicated, ep_size=1), under data parallelism or ZeRO-1/2/3,
with full or selective recomputation, tensor (and sequence) parallelism of the attention and the
pipeline, Mixtral-style and DeepSeek-style blocks (the load-balancing loss, the bias update),
routing steered so that on step 0 two experts get no token and ranks send nothing, equals one
process looping over the data-parallel shards (and micro-batches): values, losses, and the load
each bias update reads (a recomputed forward must not count it twice). The all-to-all's gradient
equals the one-process gradient; the all-to-all bytes CommCounter sees equal labkit.moe.analytic's
formula.
"""

from __future__ import annotations

import pytest
import torch

from ep_workers import SENDS, STEPS, SEQS_PER_RANK, CONFIGS, ep_rank, moe_blocks, reference_train
from labkit.dist import launch
from labkit.expert_parallel import expert_params_per_rank, experts_per_rank
from labkit.moe import all_to_all_bytes, dispatched_rows, moe_layers
from labkit.parallel import ParallelDims

pytestmark = pytest.mark.xdist_group("dist:expert_parallel")

FULL, SELECTIVE, TP = (("checkpoint", "full"),), (("checkpoint", "selective"),), (("tp_size", 2),)
PP = (("pp_size", 2), ("num_microbatches", 2))
RUNS = {  # (config, dp_size, ep_size, zero_stage, more knobs); ep_size=1: experts replicated, plain data parallelism
    2: [("mixtral", 2, 2, 0, ()), ("mixtral", 2, 2, 1, ()), ("deepseek", 2, 1, 0, ()), ("mixtral", 2, 1, 1, ()),
        ("deepseek", 2, 2, 1, FULL), ("deepseek", 2, 2, 2, FULL), ("deepseek", 1, 1, 0, PP + FULL),
        ("deepseek", 2, 2, 3, FULL)],
    4: [("mixtral", 4, 4, 0, ()), ("deepseek", 4, 2, 0, ()), ("deepseek", 4, 2, 1, ()), ("deepseek", 4, 4, 0, FULL),
        ("mixtral", 4, 2, 0, SELECTIVE), ("deepseek", 4, 2, 2, ()),
        ("mixtral", 4, 2, 2, (("num_microbatches", 2),)),  # dropless: a capacity counts a micro-batch's tokens
        ("deepseek", 2, 2, 1, TP + (("sequence_parallel", True),)), ("mixtral", 2, 2, 2, TP + FULL),
        ("deepseek", 2, 2, 2, PP), ("deepseek", 2, 2, 0, PP + (("schedule", "gpipe"),)),
        ("deepseek", 4, 2, 3, ()), ("mixtral", 4, 2, 3, FULL), ("deepseek", 2, 2, 3, PP),
        ("deepseek", 2, 2, 3, TP + (("sequence_parallel", True),))],
}


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request):
    world = request.param
    return world, launch(ep_rank, world, runs=RUNS[world], backend="gloo", timeout_s=120, join_timeout_s=600)


def _close(actual, expected):
    # float64: the ranks sum the same gradients in another order (the all-reduce, the experts'
    # rows regrouped by source rank), ~1e-16 relative per step over 3 steps; a gradient missing
    # a rank's tokens, summed twice or scaled by dp instead of dp / ep is off by more than 1e-3
    torch.testing.assert_close(actual, expected, rtol=1e-11, atol=1e-13)


def test_training_with_sharded_experts_equals_one_process(ranks):
    world, results = ranks
    for run in RUNS[world]:
        name, dp, ep = run[:3]
        more = dict(run[4])
        pp, m = more.get("pp_size", 1), more.get("num_microbatches", 1)
        ref, ref_losses, ref_loads, ref_ces = reference_train(name, world, dp, m)
        ref_biases = {i: layer.expert_bias for i, layer in moe_blocks(ref).items()}
        n_local = experts_per_rank(CONFIGS[name][0].n_experts, ep)
        held_names = set()
        for rank, res in enumerate(results):
            mine = res[run]
            # tp > 1: the one-process model's values sharded as the rank's (the worker's twin)
            ref_state = mine["want"] or dict(ref.named_parameters())
            held = {i for i in ref_loads[0] if f"blocks.{i}.mlp.router.weight" in mine["state"]}  # its MoE layers
            for step in range(STEPS):
                if pp == 1:
                    _close(torch.tensor(mine["losses"][step]), torch.tensor(ref_losses[step][mine["dp_index"]]))
                elif mine["losses"][step] is not None:  # the last stage's: the cross-entropy alone
                    _close(torch.tensor(mine["losses"][step]), torch.tensor(ref_ces[step][mine["dp_index"]]))
                # what the bias update reads: each token's choices counted once, recomputed or not
                for i in held:
                    torch.testing.assert_close(mine["loads"][step][i], ref_loads[step][i], rtol=0, atol=0)
            j = mine["ep_index"]
            assert set(mine["state"]) <= set(ref_state) and (pp > 1 or set(mine["state"]) == set(ref_state))
            held_names |= set(mine["state"])
            for pname, value in mine["state"].items():
                expected = ref_state[pname].detach()
                if ".experts." in pname:  # this rank's E / ep experts
                    expected = expected[j * n_local:(j + 1) * n_local]
                _close(value, expected)
            for i in held:
                _close(mine["biases"][i], ref_biases[i])
            if pp == 1:
                experts = sum(v.numel() for n, v in mine["state"].items() if ".experts." in n)
                assert experts == expert_params_per_rank(CONFIGS[name][0], ep)
            else:  # every stage holds a MoE layer: each stage's aux losses reach the routers
                assert held
        assert held_names == set(dict(ref.named_parameters()))


def test_all_to_all_gradient_equals_the_one_process_gradient(ranks):
    world, results = ranks
    xs = [torch.randn(sum(SENDS[world][r]), 3, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(r)).requires_grad_() for r in range(world)]
    blocks = [x.split(SENDS[world][r]) for r, x in enumerate(xs)]  # blocks[s][r]: rank s's rows for r
    ys = [torch.cat([blocks[s][r] for s in range(world)]) for r in range(world)]
    loss = sum((y * torch.randn(y.shape, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(100 + r))).sum() for r, y in enumerate(ys))
    loss.backward()
    for r, res in enumerate(results):
        y, grad = res["all_to_all"]
        # a pure permutation of rows, forward and backward: bit-equal, nothing is summed
        torch.testing.assert_close(y, ys[r].detach(), rtol=0, atol=0)
        torch.testing.assert_close(grad, xs[r].grad, rtol=0, atol=0)


def test_comm_counter_sees_the_formulas_all_to_all_bytes(ranks):
    world, results = ranks
    for run in RUNS[world]:
        name, dp, ep = run[:3]
        if ep == 1 or run[4] not in ((), SELECTIVE):
            continue  # no all-to-all (experts replicated), a recomputed forward's too, or m micro-batches' ones
        cfg = CONFIGS[name][0]
        groups, _ = ParallelDims(dp_size=dp, ep_size=ep).expert_groups()
        counted = [res[run]["counted"] for res in results]
        n_layers = len(counted[0][1])
        # the counter reads both buffers of a call, sent and received: twice the bytes sent
        expected = 2 * sum(all_to_all_bytes(sum(counted[r][1][i] for r in g), cfg.d_model, cfg.n_experts, ep, 8)
                           for g in groups for i in range(n_layers))
        assert sum(bytes_ for bytes_, _ in counted) == expected
        if cfg.capacity_factor is None:  # dropless: each rank dispatches N k rows, known from the batch
            tokens = SEQS_PER_RANK * cfg.seq_len
            assert all(k == dispatched_rows(tokens, cfg.experts_per_token) for _, kept in counted for k in kept)
        else:  # the capacity dropped rows on some rank
            assert any(k < dispatched_rows(SEQS_PER_RANK * cfg.seq_len, cfg.experts_per_token)
                       for _, kept in counted for k in kept)


def test_ep_groups_are_taken_from_the_data_parallel_ranks():
    dims = ParallelDims(dp_size=4, tp_size=2, ep_size=2)
    assert dims.world_size == 8 and dims.sizes == (4, 1, 1, 2)  # ep adds no rank and no mesh axis
    groups, replicas = dims.expert_groups()
    # dp index d = r ep + j; tp innermost: global rank = 2 d + t
    assert groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert replicas == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert sorted(r for g in groups for r in g) == list(range(8))
    with pytest.raises(ValueError, match="ep_size=3 must divide dp_size=4"):
        ParallelDims(dp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="ep_size=0 must be an int >= 1"):
        ParallelDims(dp_size=4, ep_size=0)


@pytest.mark.parametrize("dims, match", [
    (ParallelDims(dp_size=2, cp_size=2), "cp_size=2"),  # context parallelism: the one technique not composed
    (ParallelDims(dp_size=4, ep_size=4), "ep_size=4 must divide n_experts=2"),
])
def test_parallelize_refuses_what_experts_do_not_compose_with_by_name(dims, match):
    from labkit.model import GPTConfig, build_model
    from labkit.parallel.experts import check_experts_combination

    model = build_model(GPTConfig(**{**CONFIGS["mixtral"][0].to_dict(), "n_experts": 2, "experts_per_token": 1}))
    with pytest.raises(ValueError, match=match):
        check_experts_combination(model, dims)


def test_ep_size_without_experts_is_refused():
    from labkit.model import build_model, get_preset
    from labkit.parallel.experts import check_experts_combination

    with pytest.raises(ValueError, match=r"ep_size=2 needs a model with experts \(cfg.n_experts > 0\)"):
        check_experts_combination(build_model(get_preset("tiny", n_layer=1)), ParallelDims(dp_size=2, ep_size=2))


def test_expert_major_order_regroups_rows_by_expert_and_its_inverse_undoes_it():
    from labkit.expert_parallel import expert_major_order, inverse_permutation

    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # rows from rank s for local expert j, (s, j) order
    rows = torch.tensor([10, 11, 20, 30, 40, 41, 42])  # s0: e0 e0 e2 | s1: e0 e1 e1 e1 (labels: 10 s + e)
    labels = torch.tensor([0, 0, 2, 10, 11, 11, 11])  # source rank 1 is 10, expert j is j
    order = expert_major_order(counts)
    assert labels[order].tolist() == [0, 0, 10, 11, 11, 11, 2]  # expert 0 (from s0 then s1), 1, 2
    assert torch.equal(rows[order][inverse_permutation(order)], rows)
    assert expert_major_order(torch.zeros(2, 2, dtype=torch.int64)).numel() == 0  # nothing arrived


def test_all_to_all_refuses_splits_that_do_not_cover_the_rows():
    from labkit.expert_parallel import all_to_all

    with pytest.raises(ValueError, match=r"x has 3 rows but send=\[1, 1\] sums to 2"):
        all_to_all(torch.zeros(3, 2), [1, 1], [1, 1])


def test_the_benchmark_counts_what_its_ranks_ran():
    """scripts/bench_expert_parallel.py's rank function on 2 ranks: skewed routing makes the first
    rank's experts compute every row the group dispatched (and the other's none), balanced routing
    shares them out; the all-to-all bytes equal the formula; ep = 1 exchanges nothing."""
    from labkit.model import GPTConfig
    from labkit.runs.expert_parallel import ep_bench_rank

    cfg = GPTConfig(**{**CONFIGS["mixtral"][0].to_dict(), "n_layer": 1})
    out = launch(ep_bench_rank, 2, cfg, (1, 2), 2, 1, backend="gloo", timeout_s=120, join_timeout_s=600)
    for routing in ("balanced", "skewed"):
        ep1, ep2 = ([r[(ep, routing)] for r in out] for ep in (1, 2))
        assert all(r["all_to_all"] == 0 and r["computed"] == sum(r["rows"]) for r in ep1)
        sent = [sum(r["rows"]) for r in ep2]
        computed = [r["computed"] for r in ep2]
        assert sum(computed) == sum(sent)  # dropless: every dispatched row runs once
        if routing == "skewed":
            assert computed == [sum(sent), 0]
        expected = 2 * sum(all_to_all_bytes(sum(r["rows"][i] for r in ep2), cfg.d_model, cfg.n_experts, 2, 4)
                           for i in range(cfg.n_layer))
        assert sum(r["all_to_all"] for r in ep2) == expected

