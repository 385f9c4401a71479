"""labkit's pipeline runtime on real gloo ranks, against one process and torch.distributed.pipelining,
and the data x tensor x pipeline grid trained against one process.

Three launches serve every test here: 2 ranks and 4 ranks, each running every schedule on the
tiny GPT; on 2 ranks also torch's ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B on
the same split, two SGD steps through a plain training loop, and the pipeline's duties (a repeated
tied-gradient exchange, stages built from different models); on 4 ranks the synthetic workload of
controlled stage costs and the three 2-D pairs (data x tensor, tensor x pipeline, data x pipeline);
8 ranks run the 2 x 2 x 2 grid.

Equivalences are judged in float64: reassociating the sums of a step (micro-batches, ranks) moves
a float64 result by ~1e-16 of the terms' magnitude, so the bounds below (1e-9 relative) hold on
any CPU kernel or GPU, while a lost or doubled micro-batch or rank term moves it by ~1e-3 or more.
"""

import functools
import math

import pytest
import torch
from torch.testing import assert_close

from dist_workers import pipeline_and_grid, pipeline_extras
from labkit.busy import busy_note
from labkit.dist import launch
from labkit.pipeline import Timeline, bubble_fraction, max_in_flight
from labkit.runs.parallel3d import parallel_3d_rank, reference_train, references
from labkit.runs.pipeline import pipeline_rank, reference_grads

# Its module fixtures launch ranks once: every test of the file on one xdist worker, or each
# worker that picked one up would launch them again.
pytestmark = pytest.mark.xdist_group("dist:pipeline_dist")

BATCH = 8
CASES = {2: [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2)],
         4: [("gpipe", 8, 1), ("1f1b", 8, 1), ("interleaved", 4, 1)]}
# (dp, tp, pp, schedule, m, v, sequence_parallel); each trains 2 SGD steps
GRID = {4: [(2, 2, 1, "1f1b", 2, 1, False),       # data x tensor
            (1, 2, 2, "1f1b", 4, 1, True),        # tensor (with sequence parallelism) x pipeline
            (2, 1, 2, "gpipe", 2, 1, False)],     # data x pipeline
        8: [(2, 2, 2, "1f1b", 2, 1, False),       # 3D
            (2, 2, 2, "interleaved", 2, 2, True)]}
LOOP = [("1f1b", 4, 1), ("interleaved", 4, 2)]  # (schedule, m, v) trained by a plain loop on 2 ranks
SLEEP = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2)]
# a stage's forward and backward in seconds: long beside a message, which the formula counts as
# free (~0.5 ms on an idle loopback, several ms when the other test worker loads both cores);
# interleaving puts 2 v p - 2 messages on the step's critical path instead of 2 p - 2
SLEEP_COSTS = (0.15, 0.3)
GLOO = dict(backend="gloo", timeout_s=120, join_timeout_s=600)  # a loaded 2-core machine is slow
F64 = torch.float64
# float64 round-off of a reordered sum here is < 1e-14 relative; a bug is > 1e-4: bounds between
RTOL, ATOL = 1e-9, 1e-12


class _Launches(dict):
    """The three launches, each run on first use and kept: a test run that selects only some
    tests (``-m roundoff``) pays only for the launches they read."""

    @functools.cached_property
    def refs(self):
        """The grid's one-process run, computed here once rather than on every rank."""
        return references(global_batch=BATCH, dtype=F64)

    def __missing__(self, world_size):
        if world_size == 2:
            kw2 = dict(cases=CASES[2], torch_cases=CASES[2], loop_cases=LOOP, global_batch=BATCH, dtype=F64)
            out = launch(pipeline_extras, 2, kw2, **GLOO)
        elif world_size == 4:
            pipeline_kw = dict(cases=CASES[4], sleep_cases=SLEEP, global_batch=BATCH, sleep_repeats=3,
                               sleep_costs=SLEEP_COSTS, dtype=F64)
            out = launch(pipeline_and_grid, 4, pipeline_kw,
                         dict(cases=GRID[4], global_batch=BATCH, dtype=F64, refs=self.refs), **GLOO)
        else:
            out = launch(parallel_3d_rank, 8, cases=GRID[8], global_batch=BATCH, dtype=F64, refs=self.refs,
                         **GLOO)
        self[world_size] = out
        return out


@pytest.fixture(scope="module")
def runs():
    return _Launches()


@pytest.fixture(scope="module")
def reference():
    return reference_grads("tiny", BATCH, dtype=F64)


def _assert_like_unsplit(results, case, reference, rtol=RTOL, atol=ATOL):
    ref_loss, ref_grads = reference
    losses = results[-1]["losses"]
    assert len(losses) == case[1] and all(not r["losses"] for r in results[:-1])
    # float64 (module docstring): the mean of m micro-batch means is the batch mean, reordered
    assert_close(torch.tensor(losses, dtype=F64).mean(), torch.tensor(ref_loss, dtype=F64), rtol=rtol, atol=0)
    seen = set()
    for r in results:
        for name, grad in r["grads"].items():
            # float64: m micro-batch gradients summed instead of one batch gradient, reordered
            assert_close(grad, ref_grads[name], rtol=rtol, atol=atol, msg=f"{case} {name}")
            seen.add(name)
    assert seen == set(ref_grads), case  # every parameter lives on some stage
    # the tied embedding: both ends hold the same summed gradient
    assert torch.equal(results[0]["grads"]["wte.weight"], results[-1]["grads"]["wte.weight"])


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.roundoff), 4])
def test_losses_and_gradients_equal_the_unsplit_model(runs, reference, world_size):
    for case in CASES[world_size]:
        _assert_like_unsplit([r["labkit"][case] for r in runs[world_size]], case, reference)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: NCCL ranks, one GPU each")
def test_pipeline_on_cuda_with_nccl_equals_the_unsplit_model(reference):
    # NCCL pairs the messages between two ranks in order, not by tag: GPipe and 1F1B keep it on 2
    cases = [("gpipe", 4, 1), ("1f1b", 4, 1)]
    runs = launch(pipeline_rank, 2, cases=cases, global_batch=BATCH, backend="nccl", timeout_s=300, dtype=F64)
    for case in cases:
        # float64 on the GPU too: cuBLAS's other order of summation stays at round-off
        _assert_like_unsplit([r["labkit"][case] for r in runs], case, reference)


def test_torch_pipelining_gives_the_same_losses(runs):
    for case in CASES[2]:
        theirs = runs[2][-1]["torch"][case]["losses"]
        ours = runs[2][-1]["labkit"][case]["losses"]
        # same chunks, same micro-batches, same float ops in the same order: bit for bit
        assert ours == theirs, case


@pytest.mark.parametrize("world_size", [2, 4])
def test_live_microbatches_at_most_p_for_1f1b_and_m_for_gpipe(runs, world_size):
    p = world_size
    for name, m, v in CASES[p]:
        live = [r["labkit"][(name, m, v)]["peak_live"] for r in runs[p]]
        assert live == [max_in_flight(p, m, name, v, r) for r in range(p)], (name, live)
        if name == "gpipe":
            assert live == [m] * p
        if name == "1f1b":
            assert max(live) <= p < m


def test_measured_bubble_is_within_5_percent_of_the_formula(runs):
    p, measured = 4, {}
    for name, m, v in SLEEP:
        # three runs of sleeps of set length; the machine's load only ever stretches one, so
        # take the run that was least disturbed (shortest step). 5% of the formula is 5% of the
        # bubble's idle time, (p - 1)(t_f + t_b)/v = 0.68 s or more here: room for ~2.4 ms on
        # each of the 2 v p - 2 = 14 messages on the interleaved step's critical path (more for
        # GPipe and 1F1B, 6 messages); a runtime whose ranks took turns idles 1 - 1/p = 75%
        # (timeline, how many times SLEEP_COSTS its stages slept)
        tls = [(Timeline([r["sleep"][(name, m, v)][i]["events"] for r in runs[p]]), 1) for i in range(3)]
        want = bubble_fraction(p, m, name, v)
        for again in range(4):
            measured[name] = min(tls, key=lambda ts: ts[0].makespan / ts[1])[0].bubble
            if abs(measured[name] - want) <= 0.05 * want or again == 3:
                break
            # A loaded machine (a second test run beside this one) can stretch all three runs: a
            # rank waits for a core at each message, which the room above does not allow for. Three
            # more, launched afresh with stages 2, 4, then 8 times as long, at most three times:
            # the formula's fraction is the same, the messages' share of the step is smaller, and
            # a runtime that idles more than its schedule idles as much more and still fails.
            scale = 2 ** (again + 1)
            more = launch(pipeline_rank, p, sleep_cases=[(name, m, v)], sleep_repeats=3,
                          sleep_costs=tuple(c * scale for c in SLEEP_COSTS), global_batch=BATCH, dtype=F64, **GLOO)
            tls += [(Timeline([r["sleep"][(name, m, v)][i]["events"] for r in more]), scale) for i in range(3)]
        assert abs(measured[name] - want) <= 0.05 * want, (name, measured[name], want, busy_note())
    assert measured["interleaved"] < measured["1f1b"]
    # rank 0 timed a message along the chain before and after each step; the others did not
    costs = [r["sleep"][case][i]["message_s"] for case in SLEEP for r in runs[p] for i in range(3)]
    assert all((c is None) == (k % (3 * p) >= 3) for k, c in enumerate(costs)), costs
    assert all(isinstance(c, float) and 0 < c < math.inf for c in costs if c is not None), costs


def test_measured_saved_activations_1f1b_against_gpipe(runs):
    p, m = 4, 8
    for rank, r in enumerate(runs[p]):
        gpipe, one = (r["labkit"][(s, m, 1)]["peak_saved_bytes"] for s in ("gpipe", "1f1b"))
        # every micro-batch saves the same tensors: GPipe holds m of them, 1F1B p - rank
        assert one * m == gpipe * (p - rank) and one > 0, (rank, one, gpipe)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.roundoff) if c == GRID[8][0] else c
                                  for c in GRID[4] + GRID[8]], ids=str)
def test_data_tensor_pipeline_grid_trains_like_one_process(runs, case):
    dp, tp, pp, _, m = case[:5]
    results = [r[case] if dp * tp * pp == 8 else r["grid"][case] for r in runs[dp * tp * pp]]
    coords = {r["coords"]: r for r in results}
    assert sorted(coords) == [(d, s, t) for d in range(dp) for s in range(pp) for t in range(tp)]
    ref = results[0]["ref_losses"]
    assert ref[1] < ref[0]  # it trains
    for step, want in enumerate(ref):
        assert all(not r["losses"][step] for r in results if r["coords"][1] != pp - 1)
        # the last stage's m losses per replica, the same on every tensor rank
        losses = [x for d in range(dp) for x in coords[(d, pp - 1, 0)]["losses"][step]]
        for d, t in ((d, t) for d in range(dp) for t in range(tp)):
            assert coords[(d, pp - 1, t)]["losses"][step] == coords[(d, pp - 1, 0)]["losses"][step]
        assert len(losses) == dp * m
        # float64 (module docstring): the batch mean from micro-batch means, reordered
        assert_close(torch.tensor(losses, dtype=F64).mean(), torch.tensor(want, dtype=F64), rtol=RTOL, atol=0,
                     msg=f"step {step}")
    for r in results:
        for name, ours in r["params"].items():
            moved = (r["want"][name] - r["start"][name]).abs().max()
            # two SGD steps moved every weight; in float64 ours lands on the reference's to round-off
            # (~1e-14 of the move); a lost or doubled term moves it by a large part of the step
            assert moved > 0, name
            assert (ours - r["want"][name]).abs().max() <= RTOL * moved, (case, r["coords"], name)
    # every parameter lives on some stage; the replicas of a shard hold the same weights, bit for bit
    names = set().union(*(r["params"] for r in results))
    assert names == set(coords[(0, 0, 0)]["names"]), sorted(names ^ set(coords[(0, 0, 0)]["names"]))
    for (d, s, t), r in coords.items():
        twin = coords[(0, s, t)]["params"]
        assert r["params"].keys() == twin.keys()
        assert all(torch.equal(v, twin[k]) for k, v in r["params"].items()), (d, s, t)


@pytest.mark.parametrize("case", [pytest.param(LOOP[0], marks=pytest.mark.roundoff), LOOP[1]], ids=str)
def test_a_plain_training_loop_over_the_pipeline_trains_like_one_process(runs, case):
    # zero_grad(), run_schedule(...), step(): the tied embedding's exchange runs inside the step
    ref_losses, ref_model = reference_train("tiny", BATCH, steps=2, dtype=F64)
    _, start = reference_train("tiny", BATCH, steps=0, dtype=F64)
    results = [r["loop"][case] for r in runs[2]]
    for step, want in enumerate(ref_losses):
        # float64 (module docstring): the batch mean from m micro-batch means, reordered
        assert_close(torch.tensor(results[-1]["losses"][step], dtype=F64).mean(), torch.tensor(want, dtype=F64),
                     rtol=RTOL, atol=0)
    want, before = dict(ref_model.named_parameters()), dict(start.named_parameters())
    assert set().union(*(r["params"] for r in results)) == set(want)
    for r in results:
        for name, ours in r["params"].items():
            moved = (want[name] - before[name]).abs().max()
            assert moved > 0, name
            # float64: to round-off of the move; the tied embedding without its exchange misses the
            # head's (or the embedding's) gradient, a large part of the move
            assert (ours - want[name].detach()).abs().max() <= RTOL * moved, (case, name)


def test_a_repeated_tied_exchange_is_harmless_and_different_models_are_refused(runs):
    assert all(r["repeat_exchange_equal"] for r in runs[2])
    # float64: two equal steps accumulate to twice one to ~1e-16; exchanging the accumulated
    # gradient again (instead of the step's part) would add the first step's sum twice
    assert all(r["tied_accumulated_error"] <= 1e-12 for r in runs[2]), [r["tied_accumulated_error"] for r in runs[2]]
    errors = [r["init_error"] for r in runs[2]]
    assert all(e is not None and "differ across ranks" in e for e in errors), errors
