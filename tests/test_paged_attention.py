"""labkit.paged_attention: the allocator, the paged cache and paged attention against references.

The allocator and the cache are driven by random operation sequences (hypothesis) and checked
against a plain model of what they should hold; paged attention against a slow per-token loop
over the block table followed by torch's scaled_dot_product_attention.
"""

from __future__ import annotations

import math
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.model import GPTConfig, build_model
from labkit.paged_attention import cache as cache_module
from labkit.paged_attention import (DEFAULT_BLOCK_SIZE, PUBLISHED_MODELS, BlockAllocator, ContiguousAllocator,
                                    LengthDistribution, OutOfBlocksError, PagedKVCache, blocks_for_tokens,
                                    kv_bytes_per_token, kv_bytes_per_token_of, paged_attention, slot_mapping,
                                    slots_wasted_in_last_block, synthetic_trace, write_kv)

FAST = settings(max_examples=150, deadline=None)


# --- analytic -----------------------------------------------------------------------------------
def test_bytes_per_token_of_published_models():
    assert kv_bytes_per_token(*PUBLISHED_MODELS["OPT-13B"][:3], 2) == 819_200  # the paper's "800 KB"
    assert kv_bytes_per_token(*PUBLISHED_MODELS["Llama-2-7B"][:3], 2) == 2**19
    # grouped-query attention: 8 key-value heads instead of 64 for Llama-2-70B
    assert kv_bytes_per_token(*PUBLISHED_MODELS["Llama-2-70B (GQA)"][:3], 2) == 2 * 80 * 8 * 128 * 2
    cfg = GPTConfig(n_layer=3, n_head=4, d_model=64)
    cache = PagedKVCache(cfg.n_layer, cfg.n_head, cfg.head_dim, num_blocks=5, block_size=8)
    measured = sum(t.numel() * t.element_size() for t in cache.k + cache.v)  # what the cache holds
    assert measured == 5 * 8 * kv_bytes_per_token_of(cfg, dtype_bytes=4)
    assert DEFAULT_BLOCK_SIZE == 16
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert slots_wasted_in_last_block(17) == 15
    with pytest.raises(ValueError, match="n_kv_heads=0"):
        kv_bytes_per_token(2, 0, 64, 2)
    with pytest.raises(ValueError, match="block_size=0"):
        blocks_for_tokens(3, 0)


# --- the allocator ------------------------------------------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["allocate", "share", "free"]), st.integers(0, 7)), max_size=60)


@FAST
@given(num_blocks=st.integers(1, 6), ops=OPS)
def test_allocator_against_a_model(num_blocks, ops):
    alloc, refs = BlockAllocator(num_blocks, 4), {}
    for op, b in ops:
        b %= num_blocks
        if op == "allocate":
            if len(refs) == num_blocks:
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate()
            else:
                got = alloc.allocate()
                assert got not in refs
                refs[got] = 1
        elif b not in refs:  # share or free a free block: an error, and nothing changes
            with pytest.raises(ValueError, match="double free" if op == "free" else "is free"):
                getattr(alloc, op)(b)
        elif op == "share":
            alloc.share(b)
            refs[b] += 1
        else:
            alloc.free(b)
            refs[b] -= 1
            if refs[b] == 0:
                del refs[b]
        assert alloc.num_free == num_blocks - len(refs)
        assert all(alloc.ref_count(i) == refs.get(i, 0) for i in range(num_blocks))
        assert alloc.num_shared == sum(r > 1 for r in refs.values())
    for b, r in list(refs.items()):
        for _ in range(r):
            alloc.free(b)
    assert alloc.num_free == num_blocks  # nothing lost


# --- the paged cache ----------------------------------------------------------------------------
CACHE_OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free"]), st.integers(0, 50),
                               st.lists(st.integers(0, 2), min_size=1, max_size=9)), max_size=40)


def _kv(tokens):
    """What a model would store for each position: a function of the whole prefix up to it, so a
    block shared under a different prefix reads back wrong (exact in float64 below 2^40)."""
    return [float(hash(tuple(tokens[:p + 1])) % (1 << 40)) for p in range(len(tokens))]


def _read(cache, table, n):
    bs = cache.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], dtype=torch.long)
    return cache.k[0].transpose(1, 2).reshape(-1)[slots].tolist() if n else []


def _check_invariants(cache, expected):
    held = [b for table in cache.tables.values() for b in table]
    alloc = cache.allocator
    for b in range(alloc.num_blocks):  # reference counts = the tables holding a block
        assert alloc.ref_count(b) == held.count(b)
    assert alloc.num_free == alloc.num_blocks - len(set(held))  # nothing both free and in use
    for sid, tokens in expected.items():  # every sequence reads back its own prefix's values
        assert _read(cache, cache.tables[sid], len(tokens)) == _kv(tokens), sid
    # the two maps of registrations agree (a wrong or stale hit is caught by the read-back above)
    assert all(cache._entry[b][0] == h for h, b in cache._block_of_hash.items())


def _colliding_hash(parent, tokens):
    return tokens[0] % 2  # forced collisions: blocks of other contents and prefixes share a key


@FAST
@given(num_blocks=st.integers(1, 8), block_size=st.sampled_from([1, 2, 4]), ops=CACHE_OPS,
       collide=st.booleans())
def test_cache_against_a_model(num_blocks, block_size, ops, collide):
    """Random add / append / fork / free; tokens come from {0, 1, 2} so prefixes repeat and are
    shared, by live and by freed blocks; whatever is shared must read back as its own prefix,
    also when block hashes collide (a hit is verified, not taken from the hash)."""
    with mock.patch("labkit.paged_attention.cache._block_hash",
                    _colliding_hash if collide else cache_module._block_hash):
        _drive_cache(num_blocks, block_size, ops)


def _drive_cache(num_blocks, block_size, ops):
    cache = PagedKVCache(1, 1, 1, num_blocks, block_size, dtype=torch.float64)
    expected, next_id = {}, 0
    for op, pick, tokens in ops:
        live = sorted(expected)
        if op == "add" or not live:
            sid, next_id = next_id, next_id + 1
            shared = cache.add_sequence(sid, tokens)
            assert shared % block_size == 0 and shared < len(tokens)
            expected[sid] = list(tokens[:shared])
            new = tokens[shared:]
        elif op == "fork":
            parent, sid, next_id = live[pick % len(live)], next_id, next_id + 1
            cache.fork(parent, sid)
            expected[sid] = list(expected[parent])
            new = []
        elif op == "free":
            sid = live[pick % len(live)]
            cache.free_sequence(sid)
            del expected[sid]
            new = []
        else:
            sid, new = live[pick % len(live)], tokens
        if new:
            n, table = len(expected[sid]), cache.tables[sid]
            held = [b for t in cache.tables.values() for b in t]
            last_shared = n % block_size != 0 and held.count(table[-1]) > 1
            need = math.ceil((n + len(new)) / block_size) - len(table) + int(last_shared)
            if need > cache.allocator.num_free:
                before = (list(table), cache.allocator.num_free)
                with pytest.raises(OutOfBlocksError):
                    cache.reserve(sid, new)
                assert (cache.tables[sid], cache.allocator.num_free) == before  # nothing changed
                if not expected[sid] and op == "add":
                    cache.free_sequence(sid)
                    del expected[sid]
            else:
                slots = torch.tensor(cache.reserve(sid, new))  # block * block_size + offset
                values = torch.tensor(_kv(expected[sid] + new)[n:], dtype=torch.float64)
                write_kv(cache.k[0], cache.v[0], slots, values.view(-1, 1, 1), values.view(-1, 1, 1))
                expected[sid] += new
        _check_invariants(cache, expected)
    for sid in list(expected):
        cache.free_sequence(sid)
    assert cache.allocator.num_free == num_blocks  # no block lost


def test_prefix_sharing_and_copy_on_write_counts():
    cache = PagedKVCache(1, 1, 1, num_blocks=8, block_size=4)
    prompt = list(range(10))  # two full blocks and a partial one
    cache.add_sequence("a", prompt)
    cache.reserve("a", prompt)
    assert cache.add_sequence("b", prompt) == 8  # the two full blocks, not the last token's
    assert cache.tables["b"] == cache.tables["a"][:2]
    cache.fork("a", "c")
    cache.reserve("c", [7])  # c writes into the shared partial block: copied first
    assert cache.num_copies == 1 and cache.tables["c"][2] != cache.tables["a"][2]
    assert cache.tables["c"][:2] == cache.tables["a"][:2]


# --- paged attention ----------------------------------------------------------------------------
def _reference(q, k_cache, v_cache, tables, lens):
    """Per sequence: walk the block table token by token, then torch's attention with a causal offset."""
    out = []
    bs = k_cache.size(2)
    T = q.size(2)
    for b in range(q.size(0)):
        L = int(lens[b])
        keys = torch.stack([k_cache[tables[b][p // bs], :, p % bs] for p in range(L)], dim=1)  # (nh, L, hs)
        values = torch.stack([v_cache[tables[b][p // bs], :, p % bs] for p in range(L)], dim=1)
        mask = torch.arange(L)[None, :] <= (L - T + torch.arange(T))[:, None]  # (T, L), True = attend
        n_rep = q.size(1) // keys.size(0)  # grouped-query attention: kv head of query head i is i // n_rep
        keys, values = keys.repeat_interleave(n_rep, 0), values.repeat_interleave(n_rep, 0)  # (nh, L, hs)
        out.append(F.scaled_dot_product_attention(q[b], keys, values, attn_mask=mask))
    return torch.stack(out)


@pytest.mark.parametrize("T, block_size, n_kv", [
    (1, 1, 2), (1, 4, 2), (1, 16, 2), (3, 1, 2), (3, 16, 2), (1, 4, 1), (3, 4, 1),
    pytest.param(3, 4, 2, marks=pytest.mark.roundoff),  # one case re-runs on other CPU kernels
])
def test_paged_attention_equals_contiguous_attention(T, block_size, n_kv):
    g = torch.Generator().manual_seed(block_size * 10 + T)
    B, nh, hs, num_blocks = 4, 2, 8, 40  # n_kv = 1 < nh: grouped-query attention
    k_cache = torch.randn(num_blocks, n_kv, block_size, hs, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, n_kv, block_size, hs, generator=g, dtype=torch.float64)
    lens = torch.randint(T, 5 * block_size + 1, (B,), generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    tables, width = [], max(math.ceil(int(n) / block_size) for n in lens)
    for n in lens:
        m = math.ceil(int(n) / block_size)
        tables.append([perm.pop() for _ in range(m)] + [0] * (width - m))
    q = torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64)
    got = paged_attention(q, k_cache, v_cache, torch.tensor(tables), lens)
    # fp64: the two differ only in summation order
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, tables, lens), rtol=1e-12, atol=1e-12)


def test_paged_attention_rejects_bad_shapes():
    k = torch.zeros(4, 2, 4, 8)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention(torch.zeros(2, 2, 1, 8), k, k, torch.zeros(2, 1, dtype=torch.long), torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(torch.zeros(2, 2, 1, 8), k, k, torch.zeros(3, 1, dtype=torch.long), torch.tensor([1, 1]))


@pytest.mark.roundoff
def test_the_model_through_a_paged_cache_matches_its_full_forward():
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=40, vocab_size=64)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float64).eval()
    idx = torch.randint(0, 64, (3, 30), generator=torch.Generator().manual_seed(1))
    cache = PagedKVCache.for_model(model, num_blocks=30, block_size=4)
    outs = []
    with torch.no_grad():
        for a, b in [(0, 11), (11, 12), (12, 30)]:  # a prefill, a decode step, a longer chunk
            for i in range(3):
                if a == 0:
                    cache.add_sequence(i, idx[i, :b].tolist())
                cache.reserve(i, idx[i, a:b].tolist())
            outs.append(model(idx[:, a:b], kv_cache=cache.step(range(3), b - a)))
        full = model(idx)
    # fp64: only the summation order of the attention differs
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-10)


# --- bad input: a clear error naming the argument ------------------------------------------------
def test_a_negative_block_id_is_refused_not_read_from_the_end():
    k = torch.zeros(4, 2, 4, 8)
    q = torch.zeros(2, 2, 1, 8)
    for bad in (-1, 4):
        tables = torch.tensor([[0, 1], [2, bad]])
        with pytest.raises(ValueError, match=f"block id {bad}: valid ids are 0..3"):
            paged_attention(q, k, k, tables, torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="block id -1"):
        slot_mapping([3, -1], torch.arange(8), 4)


def test_booleans_are_not_block_ids_or_sizes():
    alloc = BlockAllocator(4, 16)
    alloc.allocate(), alloc.allocate()
    with pytest.raises(ValueError, match="block_id=True"):
        alloc.free(True)  # would free block 1
    assert alloc.ref_count(1) == 1
    for args, name in [((True, 16), "num_blocks=True"), ((4, True), "block_size=True")]:
        with pytest.raises(ValueError, match=name):
            BlockAllocator(*args)
    with pytest.raises(ValueError, match="num_tokens=True"):
        blocks_for_tokens(True)
    with pytest.raises(ValueError, match="n_layer=True"):
        kv_bytes_per_token(True, 2, 64, 2)


def test_unknown_sequence_ids_are_named():
    cache = PagedKVCache(1, 1, 1, num_blocks=4, block_size=4)
    cache.add_sequence("a", [1, 2, 3])
    calls = [lambda: cache.reserve("b", [1]), lambda: cache.free_sequence("b"),
             lambda: cache.fork("b", "c"), lambda: cache.blocks_needed("b", 1),
             lambda: cache.length("b"), lambda: cache.step(["a", "b"], 1)]
    for call in calls:
        with pytest.raises(ValueError, match="seq_id='b' is not in the cache"):
            call()
    assert "a" in cache and "c" not in cache  # the failed fork added nothing


_K = torch.zeros(4, 2, 4, 8)  # (num_blocks, nh, block_size, hs)
_Q, _T, _L = torch.zeros(1, 2, 1, 8), torch.tensor([[0, 1]]), torch.tensor([5])


def _cache_with(*seq_ids):
    cache = PagedKVCache(1, 2, 8, num_blocks=4, block_size=4)
    for s in seq_ids:
        cache.add_sequence(s, [1, 2])
        cache.reserve(s, [1, 2])
    return cache


MORE_BAD = [  # each was once a silent wrong result (read or written from the end, a truncated
    # token id, a sequence written twice) or an error from deep in torch or NumPy
    (lambda: slot_mapping([0, 1], torch.tensor([-1]), 4), ValueError, "position -1 is outside"),
    (lambda: slot_mapping([0, 1], torch.tensor([8]), 4), ValueError, "position 8 is outside"),
    (lambda: slot_mapping([0, 1], torch.tensor([1]), True), ValueError, "block_size=True"),
    (lambda: write_kv(_K.clone(), _K.clone(), torch.tensor([-1]), torch.ones(1, 2, 8), torch.ones(1, 2, 8)),
     ValueError, "slot -1 is outside"),
    (lambda: write_kv(_K.clone(), _K.clone(), torch.tensor([16]), torch.ones(1, 2, 8), torch.ones(1, 2, 8)),
     ValueError, "slot 16 is outside"),
    (lambda: write_kv(_K.clone(), _K.clone(), torch.tensor([1]), torch.ones(1, 2, 6), torch.ones(1, 2, 6)),
     ValueError, "must be (N, n_kv, hs) = (1, 2, 8)"),
    (lambda: paged_attention(_Q, _K, _K, _T.float(), _L), TypeError, "block_tables.dtype=torch.float32"),
    (lambda: paged_attention(_Q, _K, _K, [[0, 1]], _L), TypeError, "block_tables must be a torch.Tensor"),
    (lambda: paged_attention(_Q, _K, _K, _T, _L.float()), TypeError, "context_lens.dtype=torch.float32"),
    (lambda: paged_attention(torch.zeros(1, 2, 1, 6), _K, _K, _T, _L), ValueError, "hs=6"),
    (lambda: paged_attention(torch.zeros(1, 3, 1, 8), _K, _K, _T, _L), ValueError, "nh=3"),
    (lambda: paged_attention(_Q, _K, _K[:3], _T, _L), ValueError, "v_cache (3, 2, 4, 8)"),
    (lambda: paged_attention(_Q.double(), _K, _K, _T, _L), ValueError, "dtypes torch.float64"),
    (lambda: _cache_with("a").reserve("a", [-5]), ValueError, "tokens[0]=-5"),
    (lambda: _cache_with("a").reserve("a", [1.7]), ValueError, "tokens[0]=1.7"),
    (lambda: _cache_with("a").reserve("a", [True]), ValueError, "tokens[0]=True"),
    (lambda: _cache_with().add_sequence("a", "ab"), TypeError, "tokens must be a list of token ids"),
    (lambda: _cache_with("a").step([], 1), ValueError, "seq_ids is empty"),
    (lambda: _cache_with("a").step(["a", "a"], 2), ValueError, "seq_id='a' appears more than once"),
    (lambda: PagedKVCache(1, 2, 8, 4, 4, dtype=torch.int32), TypeError, "dtype=torch.int32"),
    (lambda: synthetic_trace(3, max_len=10, rate="1"), ValueError, "rate='1'"),
    (lambda: synthetic_trace(3, max_len=10, rate=True), ValueError, "rate=True"),
    (lambda: synthetic_trace(3, max_len=10, rate=float("inf")), ValueError, "rate=inf"),
    (lambda: synthetic_trace(3, max_len=10, scale=0), ValueError, "scale=0"),
    (lambda: synthetic_trace(3, max_len=10, scale=float("nan")), ValueError, "scale=nan"),
    (lambda: synthetic_trace(3, "sharegpt", max_len=10), TypeError, "dist='sharegpt'"),
    (lambda: LengthDistribution("x", 0, 10), ValueError, "mean_prompt=0"),
    (lambda: LengthDistribution("x", 10, 10, -1.0), ValueError, "sigma=-1.0"),
]


@pytest.mark.parametrize("call, kind, words", MORE_BAD, ids=[w for _, _, w in MORE_BAD])
def test_more_bad_input_raises_naming_it(call, kind, words):
    with pytest.raises(kind, match=re.escape(words)):
        call()


def test_the_cache_is_unchanged_by_a_refused_token():
    cache = _cache_with("a")
    with pytest.raises(ValueError, match="tokens"):
        cache.reserve("a", [3, -1])
    assert cache.length("a") == 2 and cache.tokens["a"] == [1, 2]  # as before the refused call


def test_the_contiguous_allocator_frees_only_what_it_handed_out():
    alloc = ContiguousAllocator(8)
    start = alloc.allocate(4)
    with pytest.raises(ValueError, match=r"range \(start=2, size=2\) was not allocated"):
        alloc.free(2, 2)  # once accepted: [2, 4) free while its owner still held [0, 4)
    with pytest.raises(ValueError, match="has size 4"):
        alloc.free(start, 3)
    assert alloc.num_free == 4 and alloc.allocate(5) is None  # nothing was freed by the refusals
    alloc.free(start, 4)
    assert alloc.num_free == 8 and alloc.largest_gap == 8
    with pytest.raises(ValueError, match="was not allocated"):
        alloc.free(start, 4)  # a double free
