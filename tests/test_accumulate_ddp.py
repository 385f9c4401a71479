"""Data-parallel accumulation on 2 real gloo ranks: all-reduce counts with and without no_sync.

One launch runs both variants under torch's DDP and labkit's ``DataParallelBucketed``
(spawning ranks costs seconds), and the test checks everything on it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.runs.accumulate import ddp_window_worker
from labkit.data import get_padded_batch, load_corpus
from labkit.dist import launch
from labkit.model import build_model, get_preset

CFG = get_preset("tiny", n_layer=2, seq_len=32)


@pytest.mark.roundoff
def test_no_sync_all_reduces_once_per_window_with_identical_results():
    world_size, k, lr = 2, 2, 0.1
    gen = torch.Generator().manual_seed(0)
    # ranks get different token counts (rank 0: 69, rank 1: 66): the window needs the global N
    x, y = get_padded_batch(load_corpus(), [32, 30, 4, 3, 28, 5, 31, 2], CFG.seq_len, generator=gen)  # (8, 32)
    ranks = launch(ddp_window_worker, world_size, CFG, x, y, k, lr=lr, bucket_cap_mb=100.0,
                   wrappers=("torch", "labkit"), backend="gloo")
    variants = ("no_sync", "every_step", "labkit_no_sync", "labkit_every_step")

    n_params = ranks[0]["n_params"]
    assert n_params * 4 < 100 * 2**20  # all fp32 gradients fit one 100 MB bucket: one call per round
    for r in ranks:
        # What is counted: all_reduce calls and elements during the window's k forward/backward passes.
        # no_sync: one round over all the gradients, at the last micro-step.
        # labkit's DataParallelBucketed.no_sync() must behave as DDP's.
        for prefix in ("", "labkit_"):
            assert (r[prefix + "no_sync"]["all_reduce_calls"], r[prefix + "no_sync"]["all_reduce_numel"]) \
                == (1, n_params)
            # without it: one round per micro-step.
            assert (r[prefix + "every_step"]["all_reduce_calls"], r[prefix + "every_step"]["all_reduce_numel"]) \
                == (k, k * n_params)

    # One SGD step on the whole batch, in one process, by the model's own mean loss: in fp32 and,
    # as the reference, in float64.
    torch.manual_seed(0)
    ref = build_model(CFG)
    ref64 = copy.deepcopy(ref).double()
    loss = ref(x, y)
    loss.backward()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    ref64(x, y).backward()
    torch.optim.SGD(ref64.parameters(), lr=lr).step()
    want32, want64 = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (ref, ref64))
    # the flash-attention test rule: no further from float64 than twice the one-process fp32 step
    # is, that distance measured in this run (floored at one fp32 ulp of the parameters' norm)
    floor = max((want32.double() - want64).norm(), 2**-24 * want64.norm())

    for name in variants:
        p0, p1 = (torch.from_numpy(r[name]["params"]) for r in ranks)
        assert torch.equal(p0, p1)  # exact: every rank applies the same all-reduced gradient
        assert (p0.double() - want64).norm() <= 2 * floor, name
        # the ranks' loss shares add up to the mean loss: fp32 sums of n = 8 * 32 terms err by at
        # most ~n u relative (u = 2^-24), whatever the machine
        n = y.numel()
        assert abs(sum(r[name]["loss"] for r in ranks) - loss.item()) <= 4 * n * 2**-24 * loss.item()
