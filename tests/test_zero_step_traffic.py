"""ZeRO's traffic per step as the mechanisms run it, counted on real ranks, is the step-time model's.

Stages 0-1 reduce once a step whatever the number of micro-batches; stage 2 reduce-scatters after
every micro-batch's backward; stage 3 gathers every unit for each forward and again for each
backward and reduce-scatters each backward (``labkit.zero.analytic.step_comm_volume``). The
planner's step model (``labkit.plan.steptime``) charges those elements, at 2 bytes and a ring's
(N_d - 1)/N_d: its bytes are checked against CommCounter's count of one step of
``parallelize_gpt`` on 2 gloo ranks."""

from __future__ import annotations

import pytest

from labkit.dist import launch
from labkit.model import GPTConfig
from labkit.parallel.config import RunConfig
from labkit.plan.steptime import step_time
from labkit.shapes import ModelShape
from labkit.zero.analytic import comm_volume, step_comm_volume

from parallel_workers import counted_step_rank

pytestmark = pytest.mark.xdist_group("dist:test_zero_step_traffic")

CFG = GPTConfig(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=8)
CASES = [(z, m) for z in (0, 1, 2, 3) for m in (1, 4)]


@pytest.fixture(scope="module")
def counted():
    return launch(counted_step_rank, 2, CASES, CFG, global_batch=8, timeout_s=120, join_timeout_s=300)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"zero{z}-m{m}" for z, m in CASES])
def test_each_stage_moves_per_step_what_step_comm_volume_says(counted, i):
    zero_stage, m = CASES[i]
    psi = ModelShape.from_config(CFG).num_params()
    for rank in counted:
        got = rank[i]
        assert got["n_params"] == psi  # no ZeRO padding here: every unit's size is even
        numel = {k: v["numel"] for k, v in got["comm"].items()}
        want = step_comm_volume(psi, zero_stage, m)
        if zero_stage == 0:  # one all-reduce of the accumulated gradients: a reduce-scatter and an all-gather's worth
            assert numel == {"all_reduce": psi} and comm_volume(numel) == sum(want.values())
        else:
            assert numel == want, (zero_stage, m, numel, want)
    # stage 2 and 3 grow with m, stages 0-1 do not
    by_m = {mm: comm_volume({k: v["numel"] for k, v in counted[0][CASES.index((zero_stage, mm))]["comm"].items()})
            for mm in (1, 4)}
    assert (by_m[4] > by_m[1]) == (zero_stage >= 2)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"zero{z}-m{m}" for z, m in CASES])
def test_the_step_models_data_bytes_are_the_counted_elements(counted, i):
    zero_stage, m = CASES[i]
    shape = ModelShape.from_config(CFG)
    run = RunConfig(dp_size=2, zero_stage=zero_stage, num_microbatches=m, seq_len=CFG.seq_len).check(shape)
    step = step_time(run, shape, num_gpus=2, gpus_per_node=8, peak=1e12, efficiency=0.5, nvlink_gbps=100.0,
                     network_gbps=25.0)
    counted_elements = comm_volume({k: v["numel"] for k, v in counted[0][i]["comm"].items()})
    ring = (2 - 1) / 2  # what each of N_d = 2 ranks sends of a ring collective's full-size tensor
    assert step.comm_bytes["data"] == counted_elements * 2 * ring
