"""labkit.attention, the core every attention in labkit calls, against PyTorch's own attention.

The reference is ``F.scaled_dot_product_attention`` with an explicit boolean mask built from
positions here (it shares no code with labkit), in float64: agreement to float64 round-off.
"""

import pytest
import torch
import torch.nn.functional as F

from labkit.attention import causal_mask, merge_attention, reference_attention

F64 = dict(dtype=torch.float64)
TOL = dict(rtol=1e-12, atol=1e-12)  # float64, sums of a few dozen terms: round-off ~1e-15


def _qkv(B=2, h=4, h_kv=4, s_q=5, s_k=7, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, s_q, d, generator=g, dtype=dtype)
    k = torch.randn(B, h_kv, s_k, d, generator=g, dtype=dtype)
    v = torch.randn(B, h_kv, s_k, d, generator=g, dtype=dtype)
    return q, k, v


def _sdpa(q, k, v, visible=None):
    """PyTorch's attention, kv heads repeated by hand, a mask from positions or none."""
    n_rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def _visible(s_q, s_k, q_offset, k_offset):
    """True where key position k_offset + j <= query position q_offset + i, entry by entry."""
    return torch.tensor([[k_offset + j <= q_offset + i for j in range(s_k)] for i in range(s_q)])


def test_causal_mask_by_its_definition_and_bottom_right_default():
    assert torch.equal(causal_mask(3, 5, q_offset=4, k_offset=2), _visible(3, 5, 4, 2))
    assert torch.equal(causal_mask(3, 5), _visible(3, 5, 2, 0))  # the last 3 of 5 positions
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())
    assert not causal_mask(2, 3, q_offset=0, k_offset=4).any()  # queries before every key
    window = causal_mask(6, 6, sliding_window=3)
    assert [[bool(window[i, j]) for j in range(6)] for i in range(6)] == [
        [0 <= i - j < 3 for j in range(6)] for i in range(6)]
    per_seq = causal_mask(2, 4, q_offset=torch.tensor([1, 2]))  # (B, s_q, s_k)
    assert torch.equal(per_seq, torch.stack([_visible(2, 4, 1, 0), _visible(2, 4, 2, 0)]))


@pytest.mark.parametrize("h_kv", [4, 1])
def test_values_may_have_their_own_head_size(h_kv):
    """MLA's values are smaller than its keys (labkit.mla): out (..., s_q, d_v), as SDPA's."""
    q, k, _ = _qkv(h_kv=h_kv, d=12)
    v = torch.randn(2, h_kv, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # d_v = 6
    out = reference_attention(q, k, v, causal=True)
    assert out.shape == (2, 4, 5, 6)
    assert torch.allclose(out, _sdpa(q, k, v, _visible(5, 7, 2, 0)), **TOL)


@pytest.mark.parametrize("h, h_kv, d", [(4, 4, 8), (4, 2, 5), (6, 1, 3)])
@pytest.mark.parametrize("s_q, s_k, q_offset, k_offset", [
    (7, 7, None, 0), (3, 7, None, 0), (4, 6, 10, 7), (5, 3, 2, 0)])
def test_reference_attention_equals_sdpa_in_float64(h, h_kv, d, s_q, s_k, q_offset, k_offset):
    q, k, v = _qkv(h=h, h_kv=h_kv, s_q=s_q, s_k=s_k, d=d)
    assert torch.allclose(reference_attention(q, k, v), _sdpa(q, k, v), **TOL)
    qo = k_offset + s_k - s_q if q_offset is None else q_offset
    vis = _visible(s_q, s_k, qo, k_offset)
    out, lse = reference_attention(q, k, v, causal=True, q_offset=q_offset, k_offset=k_offset, return_lse=True)
    seen = vis.any(-1)  # rows that see some key; SDPA gives nan on the others
    torch.testing.assert_close(out[..., seen, :], _sdpa(q, k, v, vis)[..., seen, :], **TOL)
    assert torch.equal(out[..., ~seen, :], torch.zeros_like(out[..., ~seen, :]))
    n_rep = h // h_kv
    scores = q @ k.repeat_interleave(n_rep, 1).transpose(-2, -1) / d ** 0.5
    want_lse = torch.logsumexp(scores.masked_fill(~vis, float("-inf")), -1)
    torch.testing.assert_close(lse, want_lse, **TOL)  # -inf on rows that see nothing
    assert lse.dtype == torch.float64 and not out.isnan().any()


def test_fully_masked_rows_have_zero_output_and_zero_gradient():
    q, k, v = (t.requires_grad_() for t in _qkv(s_q=3, s_k=4))
    out, lse = reference_attention(q, k, v, causal=True, q_offset=0, k_offset=2, return_lse=True)
    assert torch.equal(lse[..., :2], torch.full_like(lse[..., :2], float("-inf")))
    (out.sum() + lse[..., 2:].sum()).backward()
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    assert torch.equal(q.grad[..., :2, :], torch.zeros_like(q.grad[..., :2, :]))


def test_low_precision_softmax_runs_in_float32_and_lse_is_float32():
    q, k, v = _qkv(dtype=torch.bfloat16)
    out, lse = reference_attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = _sdpa(*(t.double() for t in (q, k, v)), _visible(5, 7, 2, 0))
    plain = _sdpa(q, k, v, _visible(5, 7, 2, 0))  # PyTorch's own bf16 attention
    # Flash-attention's rule: no worse than twice PyTorch's own error at this precision
    assert (out.double() - ref).abs().max() <= 2 * (plain.double() - ref).abs().max() + 1e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h_kv", [4, 2])
def test_merging_two_halves_of_the_keys_equals_the_whole(causal, h_kv):
    q, k, v = _qkv(h_kv=h_kv, s_q=6, s_k=10)
    q_off = 4  # queries at positions 4..9, keys at 0..9: the first half of the keys is all visible
    whole, whole_lse = reference_attention(q, k, v, causal=causal, q_offset=q_off, return_lse=True)
    a = reference_attention(q, k[..., :5, :], v[..., :5, :], causal=causal, q_offset=q_off, return_lse=True)
    b = reference_attention(q, k[..., 5:, :], v[..., 5:, :], causal=causal, q_offset=q_off, k_offset=5,
                            return_lse=True)
    out, lse = merge_attention(*a, *b)
    torch.testing.assert_close(out, whole, **TOL)
    torch.testing.assert_close(lse, whole_lse, **TOL)
    out2, lse2 = merge_attention(*b, *a)  # the merge is symmetric
    torch.testing.assert_close(out2, whole, **TOL)


def test_merge_is_safe_when_a_part_saw_no_key():
    out_a, lse_a = torch.randn(3, 4, **F64), torch.randn(3, **F64)
    empty_out, empty_lse = torch.zeros(3, 4, **F64), torch.full((3,), float("-inf"), **F64)
    out, lse = merge_attention(out_a, lse_a, empty_out, empty_lse)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = merge_attention(empty_out, empty_lse, empty_out.clone().requires_grad_(), empty_lse)
    assert torch.equal(out, empty_out) and torch.equal(lse, empty_lse)


def test_sliding_window_and_dropout_free_mask_argument():
    q, k, v = _qkv(s_q=6, s_k=6)
    window = causal_mask(6, 6, sliding_window=2)
    got = reference_attention(q, k, v, causal=True, sliding_window=2)
    torch.testing.assert_close(got, _sdpa(q, k, v, window), **TOL)
    torch.testing.assert_close(reference_attention(q, k, v, mask=window), got, **TOL)


@pytest.mark.parametrize("call, match", [
    (lambda: reference_attention(*_qkv(h=4, h_kv=3)), r"h_kv=3 heads, which must divide q's h=4"),
    (lambda: reference_attention(*_qkv()[:2], _qkv(s_k=6)[2]), r"k.shape=.* and v.shape=.* must be equal"),
    (lambda: reference_attention(_qkv(d=4)[0], *_qkv()[1:]), r"q.shape=.* and k.shape"),
    (lambda: reference_attention(_qkv(B=3)[0], *_qkv()[1:]), r"q.shape=.* and k.shape"),
    (lambda: reference_attention(*_qkv(), causal=1), r"causal=1"),
    (lambda: reference_attention(*_qkv(), scale="x"), r"scale='x'"),
    (lambda: reference_attention(*_qkv(), causal=True, q_offset=-1), r"q_offset=-1"),
    (lambda: reference_attention(*_qkv(), mask=torch.ones(5, 7)), r"mask must be a bool tensor"),
    (lambda: reference_attention(_qkv()[0].long(), *_qkv()[1:]), r"q.dtype=torch.int64"),
    (lambda: reference_attention(*_qkv(), softmax_dtype="float32"), r"softmax_dtype='float32'"),
    (lambda: causal_mask(0, 3), r"s_q=0"),
    (lambda: causal_mask(2, 3, k_offset=True), r"k_offset=True"),
    (lambda: causal_mask(2, 3, sliding_window=0), r"sliding_window=0"),
    (lambda: merge_attention(torch.zeros(3, 4), torch.zeros(3), torch.zeros(3, 5), torch.zeros(3)), r"out_a"),
])
def test_bad_input_raises_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
