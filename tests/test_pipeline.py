"""labkit.pipeline without processes: schedules, the simulator, the split, FLOPs, bad input.

References that share no code with what they check: a hand-written 1F1B list (the schedule of
Narayanan et al. 2021a, Figure 4), the formulas of ``analytic`` against timelines built event by
event, a brute-force search for the split, and FlopCounterMode for ``training_flops``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from labkit.shapes import ModelShape
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from labkit.model import GPTConfig, build_model, training_flops
from labkit.pipeline import (Action, bubble_fraction, build_chunks, comm, exchange_tied_grad,
                             make_schedule, max_in_flight, p2p_messages, peak_in_flight, run_schedule,
                             replay, schedule_1f1b, schedule_gpipe, schedule_interleaved, simulate,
                             split_stages)
from labkit.pipeline.simulate import Timeline
from labkit.runs.parallel3d import train_3d

F, B = (lambda i, c=0: Action("F", i, c)), (lambda i, c=0: Action("B", i, c))
GRID = [(2, 4, 1), (4, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (2, 6, 3)]


def test_1f1b_for_two_stages_and_four_microbatches_is_the_papers_list():
    assert schedule_1f1b(2, 4) == [[F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)],
                                   [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]]
    assert schedule_gpipe(2, 2) == [[F(0), F(1), B(0), B(1)]] * 2


@pytest.mark.parametrize("p,m,v", GRID)
def test_every_schedule_runs_each_forward_and_backward_once(p, m, v):
    for name in ("gpipe", "1f1b", "interleaved"):
        vv = v if name == "interleaved" else 1
        sched = make_schedule(name, p, m, vv)
        for acts in sched:
            want = {(k, i, c) for k in "FB" for i in range(m) for c in range(vv)}
            assert len(acts) == len(want) and {tuple(a) for a in acts} == want
            for a in acts:  # a backward comes after its own forward on the rank
                assert acts.index(Action("F", a.mb, a.chunk)) < acts.index(Action("B", a.mb, a.chunk))


@pytest.mark.parametrize("p,m,v", GRID)
@pytest.mark.parametrize("costs", [(1.0, 2.0), (1.0, 1.0), (0.3, 1.7)])
def test_simulated_bubble_equals_the_formula_exactly(p, m, v, costs):
    for name in ("gpipe", "1f1b", "interleaved"):
        vv = v if name == "interleaved" else 1
        tl = simulate(make_schedule(name, p, m, vv), costs[0] / vv, costs[1] / vv)
        # equal costs per stage: the bubble is the formula, up to float summation (1e-12)
        assert abs(tl.bubble - bubble_fraction(p, m, name, vv)) < 1e-12, name
        assert abs(tl.makespan * (1 - tl.bubble) - m * sum(costs)) < 1e-9  # busy = m (t_f + t_b)


@pytest.mark.parametrize("p,m,v", GRID)
def test_peak_in_flight_from_the_lists_matches_max_in_flight(p, m, v):
    for name in ("gpipe", "1f1b", "interleaved"):
        vv = v if name == "interleaved" else 1
        sched = make_schedule(name, p, m, vv)
        assert [peak_in_flight(a) for a in sched] == [max_in_flight(p, m, name, vv, r) for r in range(p)]
    assert all(peak_in_flight(a) <= p for a in schedule_1f1b(p, m))
    assert all(peak_in_flight(a) == m for a in schedule_gpipe(p, m))


def test_interleaving_cuts_the_bubble_and_costs_v_times_the_messages():
    assert bubble_fraction(4, 8, "interleaved", 2) < bubble_fraction(4, 8, "1f1b")
    assert p2p_messages(4, 8, 2) > 2 * p2p_messages(4, 8) - 1  # 2m(vp - 1) against 2m(p - 1)
    assert simulate(schedule_interleaved(4, 8, 1)).bubble == simulate(schedule_1f1b(4, 8)).bubble


def test_replay_keeps_a_timeline_and_waits_for_a_stretched_action():
    sched = make_schedule("gpipe", 4, 8)
    tl = simulate(sched, 1.0, 2.0)
    again = replay(tl, sched)
    assert again.events == tl.events  # the durations it was built from: the same timeline
    # stretch the last stage's first forward by 0.5 s: it lies on GPipe's critical path (F0
    # down the stages, the last stage's forwards and backwards, B7 back up), so the step ends
    # 0.5 s later, while rank 0's forwards, which wait for nothing, keep their times
    events = [list(ev) for ev in tl.events]
    a, start, end = events[3][0]
    events[3][0] = (a, start, end + 0.5)
    late = replay(Timeline(events), sched)
    assert late.makespan == pytest.approx(tl.makespan + 0.5, abs=1e-12)
    assert [e[1] for e in late.events[0][:8]] == [e[1] for e in tl.events[0][:8]]  # rank 0's forwards
    with_comm = replay(tl, sched, comm_cost=0.25)  # 2 (p - 1) messages on the critical path
    assert with_comm.makespan == pytest.approx(tl.makespan + 6 * 0.25, abs=1e-12)
    with pytest.raises(ValueError, match="different actions"):
        replay(tl, make_schedule("gpipe", 4, 4))
    with pytest.raises(TypeError, match="recorded=list"):
        replay(tl.events, sched)


def test_a_deadlocking_schedule_is_refused():
    bad = [[F(0), B(0)], [B(0), F(0)]]  # rank 1 waits for a backward that needs its own forward
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad)


@pytest.mark.parametrize("call,match", [
    (lambda: schedule_1f1b(4, 2), "num_microbatches=2 < pp_size=4"),
    (lambda: schedule_interleaved(4, 6, 2), "num_microbatches=6 must be a multiple of pp_size=4"),
    (lambda: schedule_gpipe(0, 4), "pp_size=0"),
    (lambda: bubble_fraction(2, 4, "gpipe", v=2), "v=2"),
    (lambda: bubble_fraction(2, 4, "zb"), "schedule='zb'"),
    (lambda: make_schedule("zb", 2, 4), "schedule='zb'"),
    (lambda: max_in_flight(2, 4, "1f1b", rank=2), "rank=2"),
    (lambda: make_schedule("gpipe", 2, 4, v=2), "v=2 applies to schedule='interleaved' only"),
    (lambda: make_schedule("1f1b", 2, 4, v=2), "v=2 applies to schedule='interleaved' only"),
    (lambda: schedule_1f1b(True, 4), "pp_size=True"),
])
def test_bad_schedule_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


CFG = GPTConfig(n_layer=6, n_head=2, d_model=16, seq_len=8, vocab_size=32)


def test_split_balances_parameters_as_well_as_a_brute_force_search():
    model = build_model(CFG)
    per = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    first = model.wte.weight.numel() + model.wpe.weight.numel()
    last = sum(p.numel() for p in model.ln_f.parameters()) + model.lm_head.weight.numel()
    for p in (2, 3, 4):
        ranges = split_stages(model, p)
        assert ranges[0][0] == 0 and ranges[-1][1] == 6 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))

        def worst(cuts):
            bounds = list(zip((0,) + cuts, cuts + (6,)))
            return max(sum(per[i:j]) + (first if k == 0 else 0) + (last if k == p - 1 else 0)
                       for k, (i, j) in enumerate(bounds))
        best = min(worst(c) for c in itertools.combinations(range(1, 6), p - 1))
        assert worst(tuple(r[0] for r in ranges[1:])) == best


def test_split_by_cost_and_interleaved_chunks():
    model = build_model(CFG)
    assert split_stages(model, 2, costs=[1, 1, 1, 1, 1, 5]) == [(0, 5), (5, 6)]
    assert split_stages(model, 3, v=2) == [(k, k + 1) for k in range(6)]
    # v p not dividing n_layer: the first L mod v p chunks one layer more, as the estimator counts
    assert split_stages(model, 2, v=2) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert ModelShape.from_config(CFG).stage_ranges(2, 0, v=2) == [(0, 2), (4, 5)]
    # costs are honoured with v > 1 too: the expensive last layer gets a chunk of its own
    for costs in ([1, 1, 1, 1, 1, 5], [5, 1, 1, 1, 1, 1]):
        ranges = split_stages(model, 2, v=2, costs=costs)
        heavy = costs.index(5)
        assert len(ranges) == 4 and (heavy, heavy + 1) in ranges  # alone: no chunk costs more than 5
        assert [a for a, _ in ranges[1:]] == [b for _, b in ranges[:-1]] and ranges[0][0] == 0
    chunks = build_chunks(model, split_stages(model, 3, v=2), 3, rank=1)
    assert [(c.start, c.stop) for c in chunks] == [(1, 2), (4, 5)]
    assert not chunks[0].first and not chunks[1].last
    x = torch.randint(0, 32, (2, 8))
    with torch.no_grad():  # the chunks, in pipeline order, are the model: bit for bit
        h = x
        for c in build_chunks(model, split_stages(model, 2), 2, 0) + build_chunks(model, split_stages(model, 2), 2, 1):
            h = c(h)
        assert torch.equal(h, model(x))


@pytest.mark.parametrize("call,match", [
    (lambda m: split_stages(m, 7), "pp_size=7 x v=1 stages exceed the model's n_layer=6"),
    (lambda m: split_stages(m, 4, v=2), "pp_size=4 x v=2 stages exceed the model's n_layer=6"),
    (lambda m: split_stages(m, 2, costs=[1, 2]), "n_layer=6"),
    (lambda m: split_stages(m, 0), "pp_size=0"),
    (lambda m: split_stages(m, 2, costs=[1, 1, float("inf"), 1, 1, 1]), r"costs\[2\]=inf"),
    (lambda m: split_stages(m, 2, costs=[1, 1, 1, float("nan"), 1, 1]), r"costs\[3\]=nan"),
    (lambda m: build_chunks(m, split_stages(m, 2), 2, rank=5), r"rank=5 must be an int in \[0, 1\]"),
    (lambda m: build_chunks(m, split_stages(m, 3), 2, rank=0), "ranges has 3 stages"),
])
def test_bad_split_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(build_model(CFG))


@pytest.mark.parametrize("recompute", [False, True])
def test_training_flops_equal_the_counted_flops_of_a_step(recompute):
    cfg, batch = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=48), 3
    model = build_model(cfg)
    x = torch.randint(0, 48, (batch, 16))
    # torch stops a recomputation once the saved tensors are back (skipping the MLP's last
    # matmul); Narayanan et al. count one whole forward more, so recompute it all
    with FlopCounterMode(display=False) as counter, set_checkpoint_early_stop(False):
        h = model.embed(x)
        for block in model.blocks:  # full recomputation: each block's forward runs again in backward
            h = checkpoint(block, h, use_reentrant=False) if recompute else block(h)
        model.loss(model.head(h), x).backward()
    assert counter.get_total_flops() == training_flops(cfg, batch, recompute=recompute)


def test_training_flops_match_narayanans_closed_form():
    cfg = GPTConfig(n_layer=96, n_head=96, d_model=12288, seq_len=2048, vocab_size=51200)
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    closed = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))  # their Eq. (3)
    assert abs(training_flops(cfg, B, recompute=True) / closed - 1) < 1e-12  # same sum, float rounding
    with pytest.raises(ValueError, match="global_batch=0"):
        training_flops(cfg, 0)


@pytest.mark.parametrize("call, match", [
    (lambda: train_3d(0, 8, 0, 2, 2), "dp_size=0"),
    (lambda: train_3d(0, 8, 2, 2, 1), "world_size=8: the degrees"),
    (lambda: train_3d(0, 4, 2, 1, 2, num_microbatches=3), "global_batch=8"),
    (lambda: train_3d(0, 4, 2, 1, 2, sequence_parallel=True), "sequence_parallel=True"),
])
def test_bad_3d_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_old_positional_and_house_keyword_names_give_the_same_schedule():
    assert schedule_1f1b(3, 6) == schedule_1f1b(pp_size=3, num_microbatches=6) == make_schedule("1f1b", 3, 6)
    assert bubble_fraction(4, 8) == bubble_fraction(pp_size=4, num_microbatches=8)


def _two_stage_rank0(act_shape):
    """Rank 0 of a 2-stage pipeline of the tiny test GPT: its first forward runs and sends
    (no process group is needed before the send)."""
    torch.manual_seed(0)
    model = build_model(CFG)
    chunks = build_chunks(model, split_stages(model, 2), 2, 0)
    x = torch.randint(0, 32, (4, 8))
    return run_schedule(chunks, make_schedule("gpipe", 2, 2)[0], rank=0, pp_size=2, inputs=x.chunk(2),
                        act_shape=act_shape)


def test_an_act_shape_with_the_right_size_but_the_wrong_shape_is_refused():
    # (2, 8, 16) is what stage 0 sends; (2, 16, 8) has as many elements and would be received as
    # garbage laid out in the wrong order
    with pytest.raises(ValueError, match=r"outputs shape \(2, 8, 16\) but act_shape=\(2, 16, 8\)"):
        _two_stage_rank0((2, 16, 8))
    with pytest.raises(ValueError, match="act_shape=None"):
        _two_stage_rank0(None)


def test_interleaving_on_two_stages_under_nccl_is_refused(monkeypatch):
    # NCCL pairs messages by order; no NCCL here, so stand in for its process group's answers
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="pp_size=2 with v=2 chunks a rank under NCCL"):
        comm.check_backend_order(2, 2)
    comm.check_backend_order(4, 2)  # p >= 3: the peers differ, order and tags agree
    comm.check_backend_order(2, 1)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "gloo")
    comm.check_backend_order(2, 2)  # gloo matches by tag


def test_a_tied_gradient_without_a_backward_is_refused():
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="param.grad is None"):
        exchange_tied_grad(w, 1, True)


def test_gantt_panels_on_one_time_axis_cover_the_longest_timeline():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.pipeline import plot_gantt

    tls = [simulate(make_schedule(name, 4, 4, v), 1.0 / v, 2.0 / v)
           for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))]
    fig, axes = plt.subplots(3, 1, sharex=True)
    for ax, tl in zip(axes, tls):
        plot_gantt(tl, ax=ax)
    longest = max(tl.makespan for tl in tls)
    assert tls[2].makespan < longest  # interleaving finishes first: the figure's point
    for ax, tl in zip(axes, tls):
        assert ax.get_xlim() == (0.0, longest)  # every box of every panel inside its frame
        assert all(0 <= t.get_position()[0] <= longest for t in ax.texts)
        assert all(t.get_fontsize() >= 10 for t in ax.texts)
    plt.close(fig)
