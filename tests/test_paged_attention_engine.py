"""The serving engine against plain generation, one request at a time, and its measured waste.

References that share no code with the engine: ``generate(use_cache=False)`` (the whole sequence
recomputed every step), a beam search over full forwards written here, and each sample of a
request served alone with its own seed. The model runs in float64: the engine's batched paged
attention and the reference sum in different orders, and greedy tokens are compared exactly,
which only holds on every machine when round-off (about 1e-16) is far below any gap between
the two best logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from labkit.model import GPTConfig, build_model
from labkit.paged_attention import (SHAREGPT, Engine, PagedKVCache, Request, Scheduler,
                                    synthetic_trace)
from labkit.paged_attention.contiguous import generate

CFG = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=64, vocab_size=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(CFG, dtype=torch.float64).eval()


def _plain(model, req):
    return generate(model, torch.tensor([req.prompt]), req.max_new_tokens, use_cache=False)[0, len(req.prompt):].tolist()


@pytest.mark.roundoff
def test_greedy_serving_equals_plain_generation_with_preemption(model):
    trace = synthetic_trace(10, max_len=64, rate=0.5, scale=1 / 8, vocab_size=64, seed=3)
    result = Engine(model, num_blocks=20, block_size=4).serve(trace)
    assert result.preemptions > 0  # 80 slots for ten requests: some are recomputed
    assert len(set(result.batch_sizes)) > 2  # requests joined and left the batch
    for rid, req in enumerate(trace):
        assert result.outputs[rid] == _plain(model, req), rid
    assert result.tokens_generated == sum(r.max_new_tokens for r in trace)  # recomputed, not regenerated


def test_baselines_produce_the_same_tokens_with_smaller_batches(model):
    trace = synthetic_trace(8, max_len=64, scale=1 / 32, vocab_size=64, seed=4)
    runs = {r: Engine(model, num_blocks=32, block_size=4, reservation=r).serve(trace)
            for r in ("paged", "max", "oracle")}
    assert runs["max"].outputs == runs["paged"].outputs == runs["oracle"].outputs
    assert max(runs["max"].batch_sizes) == 128 // 64  # two maximum-length ranges fit in 128 slots
    assert max(runs["paged"].batch_sizes) > max(runs["max"].batch_sizes)


def test_prefix_sharing_serves_the_same_tokens_from_fewer_blocks(model):
    prompt = list(range(1, 23))  # five full blocks of 4 and a partial one
    trace = [Request(prompt, 6), Request(prompt + [5], 6), Request(prompt[:9], 4)]
    engine = Engine(model, num_blocks=40, block_size=4)
    result = engine.serve(trace)
    assert engine.cache.num_prefix_hits == 5 + 2  # the second request's five blocks, the third's two
    assert result.blocks_used[0] < result.blocks_unshared[0]
    for rid, req in enumerate(trace):
        assert result.outputs[rid] == _plain(model, req)


def test_parallel_sampling_equals_each_sample_alone(model):
    req = Request(list(range(3, 14)), 12, n=3, temperature=1.0, seed=7)
    engine = Engine(model, num_blocks=30, block_size=4)
    together = engine.serve([req])
    alone = [Engine(model, num_blocks=30, block_size=4).serve(
        [Request(req.prompt, 12, temperature=1.0, seed=7 + i)]).outputs[0] for i in range(3)]
    assert together.outputs[0] == alone
    assert len({tuple(a) for a in alone}) > 1  # the samples differ
    assert max(together.blocks_used) < max(together.blocks_unshared)  # the prompt's blocks are shared
    assert engine.cache.num_copies > 0  # the partial last block was copied on write


def _beam_search(model, prompt, k, steps):
    """Beam search over full forwards, no cache: keep the k best (score, tokens) each step."""
    beams = [(0.0, list(prompt))]
    for _ in range(steps):
        logp = model(torch.tensor([t for _, t in beams]))[:, -1].log_softmax(-1)  # (beams, V)
        scores = torch.tensor([s for s, _ in beams], dtype=logp.dtype)[:, None] + logp
        top = scores.flatten().topk(k)
        beams = [(v, beams[i // logp.size(1)][1] + [i % logp.size(1)])
                 for v, i in zip(top.values.tolist(), top.indices.tolist())]
    return [t[len(prompt):] for _, t in beams], [s for s, _ in beams]


def test_beam_search_equals_the_reference_with_fewer_blocks(model):
    prompt = list(range(20, 37))
    engine = Engine(model, num_blocks=60, block_size=4)
    result = engine.serve([Request(prompt, 10, beam_width=4)])
    with torch.no_grad():
        tokens, scores = _beam_search(model, prompt, 4, 10)
    assert result.outputs[0] == tokens
    # float64 sums of ten log-probabilities from two different forwards: round-off near 1e-15
    torch.testing.assert_close(torch.tensor(result.scores[0]), torch.tensor(scores), rtol=1e-10,
                               atol=1e-10)
    assert max(result.blocks_used) < max(result.blocks_unshared)


def test_measured_waste_on_a_sharegpt_trace():
    """Accounting only (no forwards): ShareGPT-like lengths, OPT's 2048 positions, 16,384 slots."""
    trace = synthetic_trace(120, SHAREGPT, max_len=2048, rate=0.5, seed=0)
    waste = {}
    for r in ("paged", "max", "oracle"):
        engine = Engine(None, num_blocks=1024, block_size=16, reservation=r, max_len=2048)
        result = engine.serve(trace)
        waste[r] = result.waste
        if r == "paged":  # the accounting adds up to the blocks the allocator held, step by step
            assert waste[r].total - waste[r].external == 16 * sum(result.blocks_used)
            assert waste[r].external == 0
    assert 1 - waste["paged"].utilisation < 0.04  # the paper: 96.3% utilisation
    assert 1 - waste["max"].utilisation > 0.60
    assert waste["max"].utilisation < waste["oracle"].utilisation < waste["paged"].utilisation


def test_waste_counted_a_sequence_at_a_time_equals_the_count_block_by_block(model, monkeypatch):
    """The engine counts a step's slots in closed form, a sequence at a time, only where no block
    has two holders: there, at every step, it equals the count block by block; where a prefix or
    a beam is shared, the count is block by block."""
    from labkit.paged_attention import engine as eng

    by_sequence, by_block = eng.paged_slots_by_sequence, eng.paged_slots_by_block
    steps = {"compared": 0, "shared": 0}

    def compared(cache, final):
        assert cache.allocator.num_shared == 0
        got = by_sequence(cache, final)
        assert got == by_block(cache, final)
        steps["compared"] += 1
        return got

    def shared(cache, final):
        steps["shared"] += cache.allocator.num_shared > 0
        return by_block(cache, final)

    monkeypatch.setattr(eng, "paged_slots_by_sequence", compared)
    monkeypatch.setattr(eng, "paged_slots_by_block", shared)
    for bs in (4, 16):  # small blocks and a small budget: partial blocks, preemptions
        trace = synthetic_trace(40, SHAREGPT, max_len=512, rate=0.5, seed=bs)
        assert Engine(None, num_blocks=2048 // bs, block_size=bs, max_len=512).serve(trace).preemptions > 0
    prompt = list(range(1, 23))
    Engine(model, num_blocks=40, block_size=4).serve([Request(prompt, 6), Request(prompt + [5], 6)])
    assert steps["compared"] > 100 and steps["shared"] > 0, steps


def test_bad_requests_raise(model):
    engine = Engine(model, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="max_len=64"):
        engine.serve([Request([1] * 60, 5)])
    with pytest.raises(ValueError, match="needs 9 of the cache's 8 blocks"):
        engine.serve([Request([1] * 30, 6)])
    with pytest.raises(ValueError, match="choose one"):
        engine.serve([Request([1], 2, n=2, beam_width=2)])
    with pytest.raises(ValueError, match="reservation='pow2'"):
        Engine(model, num_blocks=8, reservation="pow2")
    with pytest.raises(ValueError, match="max_len is required"):
        Engine(None, num_blocks=8)


# --- prefix sharing: verified hits, freed blocks, fully cached prompts ---------------------------
def test_a_forced_hash_collision_shares_nothing(model, monkeypatch):
    monkeypatch.setattr("labkit.paged_attention.cache._block_hash", lambda parent, tokens: 0)
    trace = [Request(list(range(1, 14)), 5), Request(list(range(30, 43)), 5, arrival=1)]
    engine = Engine(model, num_blocks=20, block_size=4)
    result = engine.serve(trace)
    assert engine.cache.num_prefix_hits == 0  # every block's key collides; no content matches
    for rid, req in enumerate(trace):
        assert result.outputs[rid] == _plain(model, req), rid


def test_a_freed_block_is_hit_again_and_a_reused_one_is_not(model):
    prompt = list(range(1, 19))  # four full blocks of 4 and a partial one
    engine = Engine(model, num_blocks=12, block_size=4)
    first = engine.serve([Request(prompt, 4)])
    assert engine.cache.num_used_blocks == 0  # the request left; its blocks are free
    again = engine.serve([Request(prompt + [9, 9], 4)])
    assert engine.cache.num_prefix_hits == 4  # its four full blocks, freed but not reused
    # other prompts take every block, so the old blocks are reallocated: no stale hit
    engine.serve([Request(list(range(40, 62)), 4), Request(list(range(20, 40)), 4)])
    hits = engine.cache.num_prefix_hits
    late = engine.serve([Request(prompt, 4)])
    assert first.outputs[0] == late.outputs[0] == _plain(model, Request(prompt, 4))
    assert again.outputs[0] == _plain(model, Request(prompt + [9, 9], 4))
    assert engine.cache.num_prefix_hits - hits < 4  # some of the old blocks were overwritten


def test_a_fully_cached_prompt_still_computes_its_last_token(model):
    prompt = list(range(5, 21))  # exactly four full blocks: all of it cached after the first
    trace = [Request(prompt, 6), Request(prompt, 6, arrival=8), Request(prompt[:8], 3, arrival=9)]
    shared = Engine(model, num_blocks=30, block_size=4)
    result = shared.serve(trace)
    alone = Engine(model, num_blocks=30, block_size=4, prefix_sharing=False).serve(trace)
    assert shared.cache.num_prefix_hits == 3 + 1  # never the block of the last prompt token
    assert result.outputs == alone.outputs
    assert [result.outputs[i] for i in range(3)] == [_plain(model, r) for r in trace]


def test_prompts_given_as_tensors_share_like_lists(model):
    prompt = list(range(1, 19))
    counts = []
    for make in (list, torch.tensor, np.array):
        engine = Engine(model, num_blocks=20, block_size=4)
        engine.serve([Request(make(prompt), 3), Request(make(prompt + [1]), 3, arrival=1)])
        counts.append(engine.cache.num_prefix_hits)
    assert counts == [4, 4, 4]
    with pytest.raises(ValueError, match=r"prompt\[0\]=True"):
        Request(torch.tensor([True, False]), 3)
    with pytest.raises(ValueError, match=r"prompt\[0\]=1.0"):
        Request(torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(ValueError, match=r"prompt\[0\]=True"):
        Request([True, 2], 3)
    with pytest.raises(TypeError, match="prompt must be"):
        Request("hello", 3)


# --- bad input: a clear error naming the argument, never a hang or a silent result -------------
def test_max_num_seqs_and_request_widths_are_checked(model):
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match=f"max_num_seqs={bad!r}"):
            Engine(model, num_blocks=8, max_num_seqs=bad)
    engine = Engine(model, num_blocks=40, block_size=4, max_num_seqs=2)
    with pytest.raises(ValueError, match="n or beam_width.*max_num_seqs=2"):
        engine.serve([Request([1, 2], 3, n=3, temperature=1.0)])
    with pytest.raises(ValueError, match="n or beam_width.*max_num_seqs=2"):
        engine.serve([Request([1, 2], 3, beam_width=3)])


def test_request_fields_are_checked(model):
    engine = Engine(model, num_blocks=8, block_size=4)
    cases = [(dict(max_new_tokens=True), r"max_new_tokens=True"),
             (dict(temperature=-1.0), r"temperature=-1.0"),
             (dict(temperature=float("nan")), r"temperature=nan"),
             (dict(n=2.0), r"\.n=2.0"), (dict(arrival=-1), r"arrival=-1"),
             (dict(prompt=[1, 64]), r"token id 64: valid ids are 0..63")]
    for change, message in cases:
        fields = {"prompt": [1, 2], "max_new_tokens": 3, **change}
        with pytest.raises(ValueError, match=message):
            engine.serve([Request(**fields)])
    with pytest.raises(TypeError, match=r"requests\[0\] is a list"):
        engine.serve([[1, 2]])
    assert engine.cache.num_used_blocks == 0  # nothing was taken by the refused calls


class _FailingModel(torch.nn.Module):
    """The model, failing at its ``fail_at``-th forward (a fault part-way through serving)."""

    def __init__(self, model, fail_at):
        super().__init__()
        self.inner, self.cfg, self.calls, self.fail_at = model, model.cfg, 0, fail_at

    def forward(self, idx, kv_cache=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected fault")
        return self.inner(idx, kv_cache=kv_cache)


def test_a_failed_serve_releases_its_blocks(model):
    trace = synthetic_trace(6, max_len=64, scale=1 / 16, vocab_size=64, seed=5)
    flaky = _FailingModel(model, fail_at=5)
    engine = Engine(flaky, num_blocks=24, block_size=4)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.serve(trace)
    assert engine.cache.num_used_blocks == 0 and not engine.cache.sequence_ids()
    again = engine.serve(trace)  # the next valid call runs as on a fresh engine
    fresh = Engine(model, num_blocks=24, block_size=4).serve(trace)
    assert again.outputs == fresh.outputs
    assert again.batch_sizes == fresh.batch_sizes


def test_the_scheduler_admits_within_max_num_seqs_and_preempts_the_latest_admitted():
    cache = PagedKVCache(1, 1, 1, num_blocks=6, block_size=4, store=False)
    sched = Scheduler(cache, None, reservation="paged", max_len=64, max_num_seqs=2)
    sched.add([Request([1] * 4, 20), Request([2] * 4, 20), Request([3] * 4, 20, arrival=1)])
    batch = sched.schedule(0)
    assert [g.rid for g in batch.admitted] == [0, 1]  # the third would exceed max_num_seqs
    assert [n for _, n in batch.prefill] == [4, 4] and batch.decoding == []
    for step in range(1, 12):
        for g in sched.running:  # what the engine does after its forwards
            for s in g.seqs:
                s.tokens.append(0)
        batch = sched.schedule(step)
        if sched.preemptions:
            break
    # 24 slots: at 13 tokens each, two sequences need 8 blocks; the later admitted one yields
    assert sched.preemptions == 1 and [g.rid for g in sched.running] == [0]
    assert [g.rid for g in sched.waiting] == [1, 2]  # first in the queue, before the newcomer
    assert cache.length(sched.running[0].seqs[0].sid) == 13
    assert 1 not in [g.rid for g in batch.admitted]  # nothing is admitted in a preempting step


def test_more_bad_engine_input_raises_naming_it(model):
    engine = Engine(model, num_blocks=16, block_size=4)
    with pytest.raises(TypeError, match="requests must be a list of Request, got Request"):
        engine.serve(Request([1, 2], 2))  # once: "'Request' object is not iterable" from the scheduler
    with pytest.raises(TypeError, match="progress='no' must be True or False"):
        engine.serve([Request([1, 2], 2)], progress="no")
    with pytest.raises(ValueError, match="beam_width=65 exceeds vocab_size=64"):
        engine.serve([Request([1, 2], 2, beam_width=65)])  # once: topk's "selected index k out of range"
    with pytest.raises(ValueError, match=r"seed=18446744073709551615 must be an int in \[0, 18446744073709551614\]"):
        engine.serve([Request([1, 2], 2, n=2, temperature=1.0, seed=2 ** 64 - 1)])  # once an overflow mid-serve
    with pytest.raises(TypeError, match=r"model \(Linear\) must be a labkit GPT"):
        Engine(torch.nn.Linear(2, 2), num_blocks=8)
    with pytest.raises(TypeError, match="dtype=torch.int64"):
        PagedKVCache(1, 1, 1, 4, 4, dtype=torch.int64)
    # an iterable that is not a list (once: "object of type 'generator' has no len()") is served
    req = Request([3, 1, 4], 3)
    served = engine.serve(r for r in [req]).outputs[0]
    assert served == _plain(model, req)


@pytest.mark.roundoff
def test_a_llama_gqa_model_serves_the_tokens_of_plain_generation():
    """Grouped-query attention (2 kv heads for 4 query heads), rotary positions per sequence in a batch."""
    cfg = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, seq_len=64, vocab_size=64,
                    norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, bias=False)
    torch.manual_seed(0)
    llama = build_model(cfg, dtype=torch.float64).eval()
    trace = synthetic_trace(8, max_len=64, rate=0.5, scale=1 / 8, vocab_size=64, seed=3)
    engine = Engine(llama, num_blocks=20, block_size=4)
    result = engine.serve(trace)
    assert engine.cache.k[0].shape[1] == 2  # the blocks hold the kv heads only
    assert result.preemptions > 0 and max(result.batch_sizes) > 1  # batched decodes, recomputation
    for rid, req in enumerate(trace):
        assert result.outputs[rid] == _plain(llama, req), rid
