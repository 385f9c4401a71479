"""labkit.zero under faults a user meets: a re-save that fails part-way, a checkpoint of AdamW
loaded into SGD, a ZeRO-2 parameter that gets a gradient on one rank only. One 2-rank launch."""

import pytest
import torch
from torch.testing import assert_close

from labkit.dist import launch
from labkit.zero import verify_sharded
from zero_workers import BranchNet, fault_rank

# Its module fixtures launch ranks once: every test of the file on one xdist worker, or each
# worker that picked one up would launch them again.
pytestmark = pytest.mark.xdist_group("dist:zero_faults")


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero_faults") / "ckpt"
    return folder, launch(fault_rank, 2, folder, backend="gloo", timeout_s=60, join_timeout_s=300)


def test_a_failed_resave_leaves_the_earlier_checkpoint_intact(faults):
    folder, ranks = faults
    for r in ranks:  # every rank raises, none waits for the one that failed
        assert r["resave"]["error"] is not None and "rank 1" in r["resave"]["error"], r["resave"]
        assert "unchanged" in r["resave"]["error"]
        assert r["resave"]["unchanged"]  # every file of the good checkpoint, byte for byte
    assert ranks[0]["resave"]["leftovers"] == []  # the half-written folder is gone
    assert verify_sharded(folder)["world_size"] == 2


def test_an_adamw_checkpoint_is_refused_by_a_sharded_sgd(faults):
    _, ranks = faults
    for r in ranks:
        assert r["sgd"]["error"] is not None and "AdamW" in r["sgd"]["error"] and "SGD" in r["sgd"]["error"]
        assert r["sgd"]["lr"] == r["sgd"]["inner_lr"] == 0.5  # nothing was loaded


@pytest.mark.roundoff
def test_zero2_with_a_parameter_used_on_one_rank_trains_like_ddp(faults):
    _, ranks = faults
    ours, ddp = ranks[0]["branch"]["zero2"], ranks[0]["branch"]["ddp_torch"]
    assert ours.keys() == ddp.keys()
    assert all(torch.equal(v, ranks[1]["branch"]["zero2"][k]) for k, v in ours.items())  # ranks agree
    for name in ddp:
        # float64 and SGD: 3 steps of round-off stay near 1e-16, far below 1e-12, while a lost or
        # doubled branch gradient moves the branch by ~1e-2
        assert_close(ours[name], ddp[name], rtol=0, atol=1e-12, msg=name)
    torch.manual_seed(0)
    init = BranchNet().double().state_dict()
    assert not torch.equal(ours["branch.weight"], init["branch.weight"])  # the branch did train
    assert torch.equal(ours["unused.weight"], init["unused.weight"])  # unused everywhere: untouched
