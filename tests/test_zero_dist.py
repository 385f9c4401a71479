"""labkit.zero on real gloo ranks: training, memory, communication, checkpoints.

Three launches serve every test here: 2 ranks (every scheme; stages 1-3 save 2-rank
checkpoints; ToyNet from rank-dependent seeds; refusals), 4 ranks (the stages and the awkward
ToyNet; stages 1-3 save 4-rank checkpoints and resume the 2-rank ones) and 2 ranks again
(stages 1-3 resume the 4-rank ones; stage 3 tries damaged ones). A failed launch fails only
the tests that read it (see ``Launch``). Each rank trains on its rows of the same global batches, so every
scheme must match one process on all rows.
"""

import shutil

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from labkit.dist import launch
from labkit.runs.zero import RESUMABLE, STAGE, adam_agreement, reference_run, train_rank
from labkit.zero import analytic_comm_volume, comm_volume, zero_model_state_bytes
from zero_workers import ToyNet, toy_rank, zero_test_rank

# Its module fixtures launch ranks once: every test of the file on one xdist worker, or each
# worker that picked one up would launch them again.
pytestmark = pytest.mark.xdist_group("dist:zero_dist")

STEPS, LR = 4, 3e-3
KINDS_2 = ("ddp_torch", "ddp_naive", "ddp_bucketed", "zero1", "zero1_ddp", "zero1_torch", "zero2", "offload",
           "zero3", "fsdp2", "zero3_bf16", "fsdp2_bf16")
KINDS_4 = ("ddp_torch", "zero1", "zero1_torch", "zero2", "zero3", "fsdp2")
TOY_WRAPPED = ("ddp_naive", "ddp_bucketed", "zero1", "zero2", "zero3")
# The GPT runs in fp32: a scheme sums over ranks in another order than one process does, and
# AdamW magnifies the rounding of nearly-zero gradients by an amount that depends on the machine.
# So every GPT check is against the round-off measured in this run: the one-process reference
# trained again with the batch in 2 and in 4 pieces (the ranks' orders), the scheme within 4x
# that floor (adam_agreement for parameters, _assert_losses_agree for losses).
# ToyNet runs in float64: 3 steps of round-off stay near 1e-16, far below 1e-12, while a lost or
# doubled gradient moves its 82 numbers by ~1e-2.
TOY_TOL = dict(rtol=0, atol=1e-12)
FLOOR_FACTOR = 4
GLOO = dict(backend="gloo", timeout_s=120, join_timeout_s=600)  # a loaded 2-core machine is slow


class Launch:
    """The results of one launch, or the error it raised. A failed launch fails the tests that
    read its results, with its error; the launches after it still run (resuming only the
    checkpoints that exist), so one failure does not turn every other test into an error."""

    def __init__(self, fn, world_size, *args, **kwargs):
        try:
            self._results, self.error = launch(fn, world_size, *args, **kwargs), None
        except Exception as e:  # noqa: BLE001 -- reported by every test that reads the results
            self._results, self.error = None, e

    @property
    def results(self):
        if self.error is not None:
            pytest.fail(f"the launch these results come from failed: {self.error}")
        return self._results


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("zero_ckpt")


def _dirs(ckpt, world_size):
    """{kind: folder} of the checkpoints that stages 1-3 save at ``world_size`` ranks."""
    return {kind: ckpt / f"at{world_size}" / kind for kind in RESUMABLE}


def _saved(ckpt, world_size):
    """The checkpoints of ``_dirs`` that were completely written (their manifest comes last)."""
    return {kind: d for kind, d in _dirs(ckpt, world_size).items() if (d / "manifest.json").is_file()}


@pytest.fixture(scope="module")
def launch2(ckpt):
    return Launch(zero_test_rank, 2, KINDS_2, steps=STEPS, save={"dir": _dirs(ckpt, 2), "at": 2},
                  save_toy=ckpt / "toy2", check_refusals=True, toy_seed_per_rank=TOY_WRAPPED, **GLOO)


@pytest.fixture(scope="module")
def launch4(ckpt, launch2):  # after launch2: it resumes the 2-rank checkpoints that exist
    return Launch(zero_test_rank, 4, KINDS_4, steps=STEPS, save={"dir": _dirs(ckpt, 4), "at": 2},
                  resume=_saved(ckpt, 2) or None, toy_kinds=("zero1", "zero2", "zero3") + TOY_WRAPPED[:2],
                  **GLOO)


@pytest.fixture(scope="module")
def damaged(ckpt, launch4):
    """Copies of stage 3's 4-rank checkpoint: a shard missing, one truncated, one from ToyNet."""
    good = _dirs(ckpt, 4)["zero3"]
    if not (good / "manifest.json").is_file() or not (ckpt / "toy2" / "manifest.json").is_file():
        return []  # the launch that should have saved them failed: its tests say so
    missing, truncated, foreign = ckpt / "missing", ckpt / "truncated", ckpt / "foreign"
    for d in (missing, truncated, foreign):
        shutil.copytree(good, d)
    (missing / "shard-00002-of-00004.pt").unlink()
    shard = truncated / "shard-00000-of-00004.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    shutil.copy(ckpt / "toy2" / "shard-00001-of-00002.pt", foreign / "shard-00001-of-00004.pt")  # ToyNet's
    return [missing, truncated, foreign, ckpt / "toy2"]


@pytest.fixture(scope="module")
def launch_resumed2(ckpt, damaged):
    bad = {"good": _dirs(ckpt, 4)["zero3"], "dirs": damaged} if damaged else None
    return Launch(zero_test_rank, 2, (), steps=STEPS, resume=_saved(ckpt, 4) or None, bad_checkpoints=bad, **GLOO)


@pytest.fixture(scope="module")
def runs2(launch2):
    return launch2.results


@pytest.fixture(scope="module")
def runs4(launch4):
    return launch4.results


@pytest.fixture(scope="module")
def resumed2(launch_resumed2):
    return launch_resumed2.results


@pytest.fixture(scope="module")
def reference():
    """(losses, params, [(losses, params) in another summation order, ...])."""
    losses, params = reference_run(STEPS, lr=LR)
    return losses, params, [reference_run(STEPS, lr=LR, pieces=p) for p in (2, 4)]


def _losses(results, kind):
    """Loss of the global batch at each step: the mean of the ranks' equal-sized batches."""
    return torch.tensor(np.mean([r[kind]["losses"] for r in results], axis=0))


def _params(results, kind):
    return {k: torch.from_numpy(v) for k, v in results[0][kind]["params"].items()}


def _assert_params_agree(ours, ref, what, others):
    agree = adam_agreement(ours, ref, LR, [p for _, p in others], factor=FLOOR_FACTOR)
    assert agree["ok"], (what, agree)


def _assert_losses_agree(ours, ref, what, others):
    """Within 4x the largest distance of the reference pair's losses (at least one fp32 ulp)."""
    ref = torch.as_tensor(ref, dtype=torch.float64)
    floor = max(max((torch.tensor(o, dtype=torch.float64) - ref).abs().max().item() for o, _ in others),
                2**-23 * ref.abs().max().item())
    assert (ours - ref).abs().max().item() <= FLOOR_FACTOR * floor, (what, ours, ref, floor)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_stage_trains_like_one_process_and_like_ddp(world_size, request, reference):
    results = request.getfixturevalue(f"runs{world_size}")
    ref_losses, ref_params, others = reference
    kinds = KINDS_2 if world_size == 2 else KINDS_4
    for kind in (k for k in kinds if not k.endswith("bf16")):
        _assert_losses_agree(_losses(results, kind), ref_losses, kind, others)
        _assert_params_agree(_params(results, kind), ref_params, kind, others)
        if world_size == 2:
            # two ranks: each averaged element is g0/2 + g1/2, one rounding in either order, so
            # every scheme must equal torch's DDP bit for bit
            assert _params(results, kind).keys() == _params(results, "ddp_torch").keys()
            for name, value in _params(results, kind).items():
                assert torch.equal(value, _params(results, "ddp_torch")[name]), (kind, name)
            assert [r[kind]["losses"] for r in results] == [r["ddp_torch"]["losses"] for r in results], kind
        else:
            _assert_params_agree(_params(results, kind), _params(results, "ddp_torch"), kind, others)


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage1_matches_zero_redundancy_optimizer_and_stage3_matches_fsdp2(world_size, request, reference):
    results, others = request.getfixturevalue(f"runs{world_size}"), reference[2]
    for ours, torchs in (("zero1", "zero1_torch"), ("zero3", "fsdp2")):
        _assert_losses_agree(_losses(results, ours), _losses(results, torchs), (ours, torchs), others)
        _assert_params_agree(_params(results, ours), _params(results, torchs), (ours, torchs), others)


def test_bf16_stage3_errs_no_more_than_fsdp2_in_bf16(runs2, reference):
    ref = torch.tensor(reference[0], dtype=torch.float64)
    ours = (_losses(runs2, "zero3_bf16") - ref).abs().max().item()
    theirs = (_losses(runs2, "fsdp2_bf16") - ref).abs().max().item()
    assert 0 < ours <= 2 * theirs  # bf16 moves the losses, and no further than FSDP2's bf16 does
    p, r = _params(runs2, "zero3_bf16"), reference[1]
    assert all(v.dtype == torch.float32 for v in p.values())  # the fp32 master weights
    assert max((p[k] - r[k]).abs().max().item() for k in r) > 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_per_rank_matches_the_stage_formulas(world_size, request):
    results = request.getfixturevalue(f"runs{world_size}")
    psi, n_tensors = results[0]["zero1"]["n_params"], results[0]["zero1"]["n_tensors"]
    for rank, res in enumerate(results):
        ddp = res["ddp_torch"]["memory"]
        for kind in ("ddp_torch", "zero1", "zero2", "zero3"):
            stage, measured = STAGE[kind], res[kind]["memory"]
            want = zero_model_state_bytes(psi, world_size, stage, precision="fp32", optimizer="adamw")
            n_groups = max(len(res[kind]["groups"]), 1)
            pad = 4 * n_groups * (world_size - 1)  # fp32 padding of each flat group
            for cat, formula in (("parameters", want.params), ("gradients", want.grads),
                                 ("optimizer", want.optimizer)):
                slack = 2 * pad + 4 * n_tensors if cat == "optimizer" else pad  # + Adam's step counters
                assert abs(measured[cat] - formula) <= slack, (rank, kind, cat, measured[cat], formula)
            sharded = {"optimizer": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
            for cat, is_sharded in sharded.items():
                ratio = measured[cat] / ddp[cat]
                assert ratio < 1.01 / world_size if is_sharded else abs(ratio - 1) < 1e-3, (kind, cat, ratio)
        # stage 3 frees a unit's gathered parameters after its forward; kept for backward, they
        # would count as activations (a block is ~17% of them here): the same forward saves the same.
        # gloo's worker threads (2 per process group) drop a finished collective, and the buffer it
        # filled, a moment after the rank resumes: on a loaded machine up to two units' gathered
        # buffers can still be alive when forward ends. That much is allowed, no more.
        acts, ddp_acts = res["zero3"]["memory"]["activations"], ddp["activations"]
        in_flight = 2 * 4 * max(-(-n // world_size) * world_size for n in res["zero3"]["groups"])  # fp32
        assert 0.99 * ddp_acts <= acts <= 1.01 * ddp_acts + in_flight, (rank, acts, ddp_acts, in_flight)


@pytest.mark.parametrize("world_size", [2, 4])
def test_communication_per_step_matches_the_analytic_volume(world_size, request):
    results = request.getfixturevalue(f"runs{world_size}")
    psi = results[0]["zero1"]["n_params"]
    for res in results:
        for kind in ("ddp_torch", "ddp_naive", "ddp_bucketed", "zero1", "zero2", "offload", "zero3"):
            if kind not in res:
                continue
            numel = {k: v["numel"] for k, v in res[kind]["comm"].items()}
            want = analytic_comm_volume(psi, STAGE[kind], world_size, res[kind]["groups"] or None)
            assert comm_volume(numel) == want, (kind, numel)
            assert psi * (3 if STAGE[kind] == 3 else 2) <= want  # the padding only adds
        z3, groups = res["zero3"]["comm"], len(res["zero3"]["groups"])
        # every unit: gathered for forward, gathered again for backward, gradients reduce-scattered
        assert z3["all_gather"]["calls"] == 2 * groups and z3["reduce_scatter"]["calls"] == groups
        assert set(res["zero1"]["comm"]) == {"reduce_scatter", "all_gather"}
        assert set(res["ddp_torch"]["comm"]) == {"all_reduce"}


def test_stage1_under_ddp_and_torch_zero_move_3psi(runs2):
    # DDP's all-reduce (2 psi) already gives every rank every gradient; the parameters then
    # travel once more (1 psi): the reduce-scatter of stage 1 proper is cheaper
    psi = runs2[0]["zero1"]["n_params"]
    for kind in ("zero1_ddp", "zero1_torch"):
        numel = {k: v["numel"] for k, v in runs2[0][kind]["comm"].items()}
        assert numel["all_reduce"] == psi and 0 <= comm_volume(numel) - 3 * psi < 2  # + padding < 2 ranks


def test_bucketed_ddp_launches_its_all_reduces_during_backward(runs2):
    for res in runs2:
        b = res["ddp_bucketed"]
        assert b["buckets"] > 1 and b["launched_in_backward"] == STEPS * b["buckets"]
        assert b["comm"]["all_reduce"]["calls"] == b["buckets"]
        naive = res["ddp_naive"]
        assert naive["comm"]["all_reduce"]["calls"] == naive["n_tensors"]  # one per parameter tensor


def test_offload_keeps_the_optimizer_states_on_the_cpu(runs2):
    for res in runs2:
        assert res["offload"]["state_on"] == ["cpu"]
        assert res["offload"]["losses"] == res["zero2"]["losses"]


def test_uneven_tied_frozen_and_unused_parameters(runs4):
    single = toy_rank(0, 1, ("single",))["single"]
    init = toy_rank(0, 1, ("single",), steps=0)["single"]["params"]
    for kind in ("zero1", "zero2", "zero3") + TOY_WRAPPED[:2]:
        losses = torch.tensor(np.mean([r["toy"][kind]["losses"] for r in runs4], axis=0))
        assert_close(losses, torch.tensor(single["losses"], dtype=torch.float64), **TOY_TOL)
        params = runs4[0]["toy"][kind]["params"]
        # the tie needs no check of its own: "single" trains head.weight and emb.weight as one
        # tensor, and a tie broken by sharding would train the two apart and fail this match
        assert params.keys() == single["params"].keys()
        for name, value in params.items():
            assert_close(torch.from_numpy(value), torch.from_numpy(single["params"][name]), **TOY_TOL)
            if name.startswith(("frozen", "unused")):  # never updated, not even by weight decay
                assert np.array_equal(value, init[name]), (kind, name)


def test_parameters_that_differ_across_ranks_are_refused_when_checked(runs2):
    for rank in runs2:
        assert set(rank["refusals"]) == set(TOY_WRAPPED)
        for wrapper, message in rank["refusals"].items():
            assert message is not None, wrapper
            assert "differ across ranks" in message and "'fc2.bias' on rank 1" in message, message


def test_ranks_seeded_differently_train_like_one_process(runs2):
    # as torch's DDP does, every wrapper starts all ranks from rank 0's parameters and buffers:
    # rank 1 built ToyNet from seed 1, and the run must still equal one process from seed 0
    single = toy_rank(0, 1, ("single",))["single"]
    model = ToyNet()
    n_tensors = len(list(model.parameters())) + len(list(model.buffers()))
    for rank in runs2:
        for kind in TOY_WRAPPED:
            res = rank["toy_seeded"][kind]
            assert res["wrap_broadcasts"] == n_tensors, kind  # counted: one broadcast per tensor
            assert_close(torch.tensor(np.mean([r["toy_seeded"][kind]["losses"] for r in runs2], axis=0)),
                         torch.tensor(single["losses"], dtype=torch.float64), **TOY_TOL)
            for name, value in res["params"].items():
                assert_close(torch.from_numpy(value), torch.from_numpy(single["params"][name]), **TOY_TOL)


@pytest.mark.parametrize("saved,resumed", [(2, 4), (4, 2)])
def test_a_checkpoint_resumes_at_another_world_size(saved, resumed, request, reference):
    at_saved = request.getfixturevalue(f"runs{saved}")
    at_resumed = request.getfixturevalue({4: "runs4", 2: "resumed2"}[resumed])
    for kind in RESUMABLE:  # stages 1 and 2 (ShardedOptimizer) and 3 (FullyShardedModule)
        resumed_kind = f"{kind}_resumed"
        assert len(at_resumed[0][resumed_kind]["losses"]) == STEPS - 2
        uninterrupted = _losses(at_saved, kind)[2:]  # steps 2.. of the run that saved at step 2
        # the resumed steps sum the gradients over another number of ranks, so in another order:
        # judged against the same floor as any two world sizes above
        others = reference[2]
        _assert_losses_agree(_losses(at_resumed, resumed_kind), uninterrupted, resumed_kind,
                             [(o[2:], p) for o, p in others])
        _assert_params_agree(_params(at_resumed, resumed_kind), _params(at_saved, kind), resumed_kind, others)


def test_damaged_checkpoints_are_refused_and_change_nothing(resumed2):
    expected = ["shard-00002-of-00004.pt (rank 2 of 4) is missing",
                "has 1000 bytes, the manifest says",
                "a shard of another checkpoint (another model or run)",
                "was saved from another model ('wte.weight' is not in it)"]
    for rank in resumed2:
        assert len(rank["bad_checkpoints"]) == len(expected)
        for (message, unchanged), want in zip(rank["bad_checkpoints"], expected):
            assert message is not None and want in message, message
            assert unchanged


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: NCCL ranks, one GPU each")
def test_the_stages_on_cuda_with_nccl():
    world_size = min(torch.cuda.device_count(), 4)
    kinds = ("ddp_torch", "zero1", "zero2", "zero3", "zero3_bf16", "offload")
    results = launch(train_rank, world_size, kinds, steps=STEPS, backend="nccl", timeout_s=300)
    # the floor measured on the GPU: the one-process reference there, in 2 and 4 pieces
    others = [reference_run(STEPS, lr=LR, pieces=p, device="cuda") for p in (1, 2, 4)]
    for kind in ("zero1", "zero2", "zero3", "offload"):
        # NCCL's reductions run in yet another order: judged against that floor
        _assert_params_agree(_params(results, kind), _params(results, "ddp_torch"), kind, others)
        _assert_losses_agree(_losses(results, kind), _losses(results, "ddp_torch"), kind, others)
    for res in results:
        assert res["offload"]["params_on"] == ["cuda"] and res["offload"]["state_on"] == ["cpu"]
        assert res["zero3"]["params_on"] == ["cuda"] and res["zero3"]["state_on"] == ["cuda"]
        # the shards are the parameters: 4 Psi / N bytes, plus the fp32 padding of each unit (< N elements)
        want = zero_model_state_bytes(res["zero3"]["n_params"], world_size, 3, precision="fp32", optimizer="adamw")
        pad = 4 * len(res["zero3"]["groups"]) * (world_size - 1)
        assert abs(res["zero3"]["memory"]["parameters"] - want.params) <= pad
