"""The serving engine against plain generation, one request at a time, and its measured waste.

References that share no code with the engine: ``generate(use_cache=False)`` (the whole sequence
recomputed every step), a beam search over full forwards written here, and each sample of a
request served alone with its own seed.
"""

from __future__ import annotations

import pytest
import torch

from labkit.paged_attention.contiguous import generate
from labkit.model import GPTConfig, build_model
from labkit.paged_attention import SHAREGPT, Engine, Request, synthetic_trace

CFG = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=64, vocab_size=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(CFG).eval()


def _plain(model, req):
    return generate(model, torch.tensor([req.prompt]), req.max_new_tokens, use_cache=False)[0, len(req.prompt):].tolist()


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
    # float32 sums of ten log-probabilities, computed by two different forwards
    torch.testing.assert_close(torch.tensor(result.scores[0]), torch.tensor(scores), rtol=1e-5, atol=1e-5)
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
