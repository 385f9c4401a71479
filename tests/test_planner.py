"""The planner against published configurations.

Feasible and near the top: Narayanan et al. (2021b), Table 1, four rows run on A100 80 GB
(8 GPUs a node, seq_len 2048, vocabulary 51,200; the shapes, GPU counts and batches are also those
of Megatron-LM's examples/sc21 launch scripts). Out of memory: Korthikanti et al. (2022), Table 3
and Figure 1: their 22B, 175B, 530B and 1T configurations (t = 8; p = 1, 8, 35, 64; one pipeline)
do not fit in 80 GB without recomputation, and fit with sequence parallelism and selective
recomputation.
"""

import pytest

from labkit.memory.analytic import embedding_bytes
from labkit.model import GPTConfig, get_preset
from labkit.plan.parallelism import NoPlanFits, plan_memory, plan_parallelism

_cfg = lambda L, a, h: GPTConfig(n_layer=L, n_head=a, d_model=h, seq_len=2048, vocab_size=51200)  # noqa: E731
# name: (config, GPUs, global batch, (t, p)) from Narayanan et al. 2021b, Table 1
NARAYANAN = {
    "145.6B": (_cfg(80, 96, 12288), 1536, 2304, (8, 8)),
    "310.1B": (_cfg(96, 128, 16384), 1920, 2160, (8, 16)),
    "529.6B": (_cfg(105, 128, 20480), 2520, 2520, (8, 35)),
    "1T": (_cfg(128, 160, 25600), 3072, 3072, (8, 64)),
}
# name: (config, p, global batch, micro-batch) from Korthikanti et al. 2022, Table 3 (t = 8)
KORTHIKANTI = {"22B": (_cfg(48, 64, 6144), 1, 4, 4), "175B": (_cfg(96, 96, 12288), 8, 64, 1),
               "530B": (_cfg(105, 128, 20480), 35, 280, 1), "1T": (_cfg(128, 160, 25600), 64, 512, 1)}


@pytest.mark.parametrize("name", sorted(NARAYANAN))
def test_published_megatron_configurations_are_feasible_and_near_the_top(name):
    cfg, n, batch, (t, p) = NARAYANAN[name]
    plans = plan_parallelism(cfg, "a100-80gb", n, 8, batch)
    assert plans and all(pl.fits and pl.t * pl.p * pl.dp == n for pl in plans)
    pairs = list(dict.fromkeys((pl.t, pl.p) for pl in plans))  # (t, p) by their fastest plan
    assert (t, p) in pairs[:5], (name, pairs[:5])  # among the five fastest (t, p)
    assert next(pl for pl in plans if (pl.t, pl.p) == (t, p)).step_time_s <= 1.05 * plans[0].step_time_s
    # what the paper ran (full recomputation, no ZeRO, no sequence parallelism) fits too
    assert any((pl.t, pl.p, pl.recompute, pl.zero, pl.sequence_parallel) == (t, p, "full", 0, False)
               for pl in plans)
    assert all(8 % pl.t == 0 for pl in plans)  # a tensor-parallel group never straddles two nodes


@pytest.mark.parametrize("name", sorted(KORTHIKANTI))
def test_configurations_the_papers_ran_out_of_memory_with_are_infeasible(name):
    cfg, p, batch, b = KORTHIKANTI[name]
    n = 8 * p  # one pipeline, N_d = 1
    plans = plan_parallelism(cfg, "a100-80gb", n, 8, batch, micro_batches=(b,), include_infeasible=True)
    bare = [pl for pl in plans if (pl.t, pl.p, pl.recompute, pl.sequence_parallel, pl.zero) == (8, p, "none", False, 0)]
    assert bare and not any(pl.fits for pl in bare)
    fixed = [pl for pl in plans if (pl.t, pl.p, pl.v, pl.recompute, pl.sequence_parallel) == (8, p, 1, "selective", True)]
    assert fixed and all(pl.fits for pl in fixed)  # their remedy, under 1F1B: sequence parallelism + selective


def test_memory_categories_follow_the_formulas():
    cfg = _cfg(96, 96, 12288)
    st0, act_none = plan_memory(cfg, 8, 8, 4, 1, 64, zero=0, recompute="none")
    st1, act_full = plan_memory(cfg, 8, 8, 4, 1, 64, zero=1, recompute="full")
    assert st1 / st0 == pytest.approx((4 + 12 / 4) / 16)  # ZeRO-1 over N_d = 4
    sbh = 2048 * 12288
    # stage 0 under 1F1B: p = 8 micro-batches in flight, each with its 12 layers (Korthikanti et al.),
    # the embedding's (s, b, h) 2-byte output and what the vocabulary-parallel lookup keeps
    # (labkit.estimate counts both)
    emb = embedding_bytes(2048, 1, pos="learned", tp_size=8)
    assert act_none == pytest.approx(8 * 12 * sbh * (10 + 24 / 8 + 5 * 96 * 2048 / (12288 * 8))
                                     + 8 * (sbh * 2 + emb))
    assert act_full < act_none / 5


def test_interleaving_memory_bubble_and_messages():
    cfg, p, m = _cfg(96, 96, 12288), 8, 64
    # the embedding's output and the vocabulary-parallel lookup's kept ids and mask, counted with
    # each chunk in flight on stage 0
    e = 2048 * 12288 * 2 + embedding_bytes(2048, 1, pos="learned", tp_size=8)
    _, one = plan_memory(cfg, 8, p, 4, 1, m, recompute="none")
    for v in (2, 3, 4):
        _, inter = plan_memory(cfg, 8, p, 4, 1, m, recompute="none", v=v)
        chunks = 2 * (p - 1) + (v - 1) * p + 1  # in flight on stage 0, each 1/v of its layers
        # Korthikanti et al. (2022), Section 4.2.3: the first stage holds 1 + (p - 1)/(p v) times
        # 1F1B's layer activations; ours comes from the schedule's own count of chunks in flight
        assert (inter - chunks * e) / (one - p * e) == pytest.approx(1 + (p - 1) / (p * v))
    plans = plan_parallelism(cfg, "a100-80gb", 8 * p * 4, 8, 4 * m, micro_batches=(1,), recompute=("full",),
                             sequence_parallel=(False,), zero_stages=(0,))
    by_v = {pl.v: pl for pl in plans if (pl.t, pl.p) == (8, p)}
    assert set(by_v) == {1, 2, 3, 4, 6}  # every v <= 8 with v p dividing L = 96
    for v, pl in by_v.items():
        assert pl.bubble == pytest.approx((p - 1) / (v * m + p - 1))
        assert pl.comm_bytes["pipeline"] == pytest.approx(v * by_v[1].comm_bytes["pipeline"])
        assert pl.schedule == ("interleaved" if v > 1 else "1f1b")


def test_bad_planner_input_names_the_argument():
    with pytest.raises(ValueError, match="n_gpus=0"):
        plan_parallelism(_cfg(4, 4, 64), "a100", 0, 8, 8)
    with pytest.raises(ValueError, match="recompute="):
        plan_parallelism(_cfg(4, 4, 64), "a100", 8, 8, 8, recompute=("some",))
    with pytest.raises(ValueError, match="interleave="):
        plan_parallelism(_cfg(4, 4, 64), "a100", 8, 8, 8, interleave=(0,))
    with pytest.raises(ValueError, match="v=3"):
        plan_memory(_cfg(4, 4, 64), 1, 2, 1, 1, 4, v=3)


SMALL = _cfg(4, 4, 64)


@pytest.mark.parametrize("kw,match", [
    (dict(efficiency=-1), r"efficiency=-1 must be a finite number in \(0, 1\]"),  # negative step times
    (dict(efficiency=3), r"efficiency=3 must be a finite number in \(0, 1\]"),    # an MFU above 1
    (dict(memory_fraction=50), r"memory_fraction=50 must be a finite number in \(0, 1\]"),
    (dict(zero_stages=(3,)), "zero_stages=3 is unknown"),                    # was KeyError: 3
    (dict(micro_batches=(0,)), "micro_batches=0"),                           # was ZeroDivisionError
    (dict(network_gbps=0), "network_gbps=0"),
    (dict(sequence_parallel=("no",)), "sequence_parallel='no' is unknown"),
])
def test_bad_planner_options_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        plan_parallelism(SMALL, "a100", 8, 8, 8, **kw)


@pytest.mark.parametrize("args,kw,match", [
    ((SMALL, 3, 1, 1, 1, 1), {}, "t=3 must divide n_head=4"),
    ((SMALL, 1, 3, 1, 1, 1), {}, "p=3 must divide n_layer=4"),
    ((SMALL, 1, 1, 0, 1, 1), {}, "dp=0"),                                    # was ZeroDivisionError
    ((SMALL, 1, 1, 1, 1, 1), dict(zero=3), "zero=3 is unknown"),            # was KeyError: 3
    ((SMALL, 1, 1, 1, 1, 1), dict(recompute="ful"), "recompute='ful' is unknown"),  # was taken as "full"
])
def test_bad_plan_memory_input_names_the_argument(args, kw, match):
    with pytest.raises(ValueError, match=match):
        plan_memory(*args, **kw)


def test_when_nothing_fits_the_planner_says_which_term_overflowed():
    with pytest.raises(NoPlanFits, match="model states alone need .* GB per GPU") as info:
        plan_parallelism(get_preset("gpt3-175b"), "t4", 1, 1, 8, dtype="fp16")
    # the leanest plan it tried: full recomputation, and still 16 bytes a parameter over the limit
    assert info.value.closest.recompute == "full" and not info.value.closest.fits
    with pytest.raises(NoPlanFits, match="no \\(t, p, N_d, b\\) splits"):
        plan_parallelism(SMALL, "a100", 8, 8, 4, micro_batches=(8,))  # N_d b never divides 4
