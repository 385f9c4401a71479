"""Context parallelism's formulas: the chunks a rank holds, its causal work, the ring's traffic.

A sequence of s tokens is cut into cp chunks (``"contiguous"``: rank i holds chunk i) or 2 cp
chunks (``"zigzag"``: rank i holds chunks i and 2cp - 1 - i, so that causal work is equal on
every rank; Llama 3's and Megatron-Core's layout, not Brandon et al. 2023's striping, which deals
tokens round-robin). In ring
attention (Liu et al. 2023) each rank sends its keys and values cp - 1 times in forward. Torch-free:
the estimator and the planner call these.
"""

from __future__ import annotations

from ..hardware import get_gpu, peak_flops
from ..memory.analytic import RECOMPUTE, lse_bytes
from ..validate import ArgumentError, check_bool, check_choice, check_int

__all__ = ["LAYOUTS", "check_cp_seq_len", "chunks_of_rank", "chunk_offsets", "causal_pairs", "computed_blocks",
           "ring_bytes_per_layer", "block_flops", "ring_step_flops", "hide_chunk_tokens",
           "attention_activation_fraction", "ring_attention_saved_bytes", "shard_rotary_bytes", "global_loss_bytes"]

LAYOUTS = ("zigzag", "contiguous")


def _n_chunks(cp_size: int, layout: str) -> int:
    return 2 * cp_size if check_choice("layout", layout, LAYOUTS) == "zigzag" else cp_size


def check_cp_seq_len(seq_len: int, cp_size: int, layout: str = "zigzag", name: str = "seq_len") -> int:
    """Return s / cp, the tokens a rank holds; raise ValueError unless cp (2 cp for zigzag) divides s."""
    check_int(name, seq_len, 1)
    check_int("cp_size", cp_size, 1)
    n = _n_chunks(cp_size, layout)
    if seq_len % n:
        need = f"2 * cp_size = {n}" if layout == "zigzag" else f"cp_size = {n}"
        raise ArgumentError(f"{name}={seq_len} must be divisible by {need} for cp_size={cp_size}, "
                            f"layout={layout!r} (pad the sequence, or pick another cp_size)", "cp_chunks",
                            name=name, seq_len=seq_len, chunks=n, cp_size=cp_size)
    return seq_len // cp_size


def chunks_of_rank(rank: int, cp_size: int, layout: str = "zigzag") -> list[int]:
    """The chunks rank holds, in order: [i] of cp chunks, or [i, 2cp - 1 - i] of 2 cp (zigzag)."""
    check_int("cp_size", cp_size, 1)
    check_int("rank", rank, 0, cp_size - 1)
    return [rank, 2 * cp_size - 1 - rank] if _n_chunks(cp_size, layout) > cp_size else [rank]


def chunk_offsets(rank: int, cp_size: int, seq_len: int, layout: str = "zigzag") -> list[tuple[int, int, int]]:
    """(local start, length, global start) of each chunk rank holds of a ``seq_len``-token sequence."""
    size = seq_len // _n_chunks(cp_size, layout)
    check_cp_seq_len(seq_len, cp_size, layout)
    return [(j * size, size, c * size) for j, c in enumerate(chunks_of_rank(rank, cp_size, layout))]


def causal_pairs(rank: int, cp_size: int, layout: str = "zigzag") -> float:
    """The causal work of rank's queries, in (query, key) pairs, as a fraction of the whole
    sequence's s²/2: a chunk of size c at chunk index j sees j c² + c²/2 pairs (itself half).

    Contiguous: (2i + 1) / cp², from 1/cp² to (2cp - 1)/cp²; zigzag: 1/cp on every rank."""
    n = _n_chunks(cp_size, layout)
    return sum((2 * j + 1) / n**2 for j in chunks_of_rank(rank, cp_size, layout))


def computed_blocks(rank: int, cp_size: int, layout: str = "zigzag") -> int:
    """Blocks of (s/n) x (s/n) scores rank computes under a causal mask, n = cp or 2 cp chunks:
    its chunk j meets j earlier chunks whole and its own diagonal one (masked, but computed)."""
    return sum(j + 1 for j in chunks_of_rank(rank, cp_size, layout))


def ring_bytes_per_layer(batch_size: int, seq_len: int, n_kv_head: int, head_dim: int, cp_size: int,
                         dtype_bytes: int = 2, direction: str = "forward") -> int:
    """Bytes one rank sends per layer: forward, its K and V shard cp - 1 times,
    2 (cp - 1) / cp · b s n_kv d bytes-per-element (that fraction of the sequence's K and V);
    backward, K and V again cp - 1 times and their gradients cp times: 2 (2cp - 1) / cp · b s n_kv d."""
    for name, value in (("batch_size", batch_size), ("n_kv_head", n_kv_head), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes)):
        check_int(name, value, 1)
    shard = 2 * batch_size * check_cp_seq_len(seq_len, cp_size, "contiguous") * n_kv_head * head_dim
    sends = {"forward": cp_size - 1, "backward": 2 * cp_size - 1}[check_choice("direction", direction,
                                                                             ("forward", "backward"))]
    return sends * shard * dtype_bytes


def block_flops(batch_size: int, n_head: int, head_dim: int, s_q: int, s_k: int) -> int:
    """Matmul FLOPs of one ring step's block in forward, unmasked: S = Q Kᵀ and O = P V,
    2 · 2 b a s_q s_k d (two multiply-adds per product element)."""
    for name, value in (("batch_size", batch_size), ("n_head", n_head), ("head_dim", head_dim),
                        ("s_q", s_q), ("s_k", s_k)):
        check_int(name, value, 1)
    return 4 * batch_size * n_head * s_q * s_k * head_dim


def ring_step_flops(batch_size: int, n_head: int, head_dim: int, chunk: int, causal: bool = True) -> float:
    """Matmul FLOPs one ring step computes in forward on a rank's ``chunk`` = s / cp tokens against
    the block of keys it holds: :func:`block_flops` of a (chunk x chunk) block, halved under a
    causal mask. In the zigzag layout every step meets half of the block's query-key pairs (two
    of its four chunk pairs off the diagonal; the diagonal step half of each triangle and one
    whole pair), and a kernel that skips masked tiles computes only those."""
    check_bool("causal", causal)
    full = block_flops(batch_size, n_head, head_dim, chunk, chunk)
    return full / 2 if causal else float(full)


def hide_chunk_tokens(gpu: str, n_head: int, n_kv_head: int, dtype: str = "bf16", dtype_bytes: int = 2,
                      causal: bool = True) -> float:
    """Tokens per rank, s / cp, above which a ring step's compute (:func:`ring_step_flops`, at the
    GPU's dense peak) lasts longer than its K and V take to cross the GPU-to-GPU link: Liu et al.
    (2023)'s condition c >= F / B, Chapter 1's roofline with the link in place of HBM (the link's
    one-way bandwidth, half of ``link_gbps``). A causal mask halves the compute, doubling the
    threshold; at a share of the peak (the planner's efficiency) it grows by the inverse share."""
    g = get_gpu(gpu)
    ridge = peak_flops(g, dtype) / (g.link_gbps * 1e9 / 2)  # FLOP per byte sent
    c, d = 1, 128  # the step's FLOPs / bytes is linear in c and free of d and b: solve at c = 1
    sent = 2 * c * check_int("n_kv_head", n_kv_head, 1) * d * dtype_bytes
    return ridge / (ring_step_flops(1, n_head, d, c, causal) / sent)


def attention_activation_fraction(cp_size: int) -> float:
    """The share of the attention's (and every per-token) activation a rank keeps: 1 / cp."""
    return 1.0 / check_int("cp_size", cp_size, 1)


def ring_attention_saved_bytes(seq_len: int, batch_size: int, n_head: int, n_kv_head: int, head_dim: int, *,
                               dtype_bytes: int, recompute: str = "none") -> dict:
    """What :class:`labkit.context_parallel.RingAttention` keeps for backward on one rank, by tensor:
    s = ``seq_len`` the rank's s/cp tokens, a and n_kv its heads, e = ``dtype_bytes``.

    Its inputs as passed, q (a hd s b e), k and v (n_kv hd s b e each: the key-value heads, never
    repeated), its output O (a hd s b e) and the fp32 log-sum-exp L (4 a s b); no (s, s) block
    outlives its step, as in FlashAttention. "selective" (the ring checkpointed): q, k, v only;
    "full": nothing (the block's input is the block's). Whether q, k, v are storages of their own
    is the caller's: in labkit's block v is a view of the qkv projection's output."""
    s, b, a, kv, hd = (check_int(n, v, 1) for n, v in (("seq_len", seq_len), ("batch_size", batch_size),
                                                       ("n_head", n_head), ("n_kv_head", n_kv_head),
                                                       ("head_dim", head_dim)))
    e = check_choice("dtype_bytes", dtype_bytes, (2, 4))
    if check_choice("recompute", recompute, RECOMPUTE) == "full":
        return {}
    token = hd * s * b * e  # one head's (b, s, hd) tensor
    kept = {"q (a hd s b e)": a * token, "k (n_kv hd s b e)": kv * token, "v (n_kv hd s b e)": kv * token}
    if recompute == "none":
        kept.update({"output O (a hd s b e)": a * token, "log-sum-exp L (4 a s b)": lse_bytes(s, b, a)})
    return kept


def shard_rotary_bytes(seq_len: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes a rotary layer keeps per rank that it does not keep without cp: cos and sin read at
    the shard's global positions, (s/cp, hd/2) each, gathered (without cp, a view of the table)
    and kept by the rotation's products: s hd e, b-free, once per layer (q and k share them)."""
    for name, value in (("seq_len", seq_len), ("head_dim", head_dim)):
        check_int(name, value, 1)
    return seq_len * head_dim * check_choice("dtype_bytes", dtype_bytes, (2, 4))


def global_loss_bytes(tp_size: int = 1) -> int:
    """Bytes the global mean loss keeps beyond a plain mean's, per micro-batch (apply's
    ``_global_loss``): the whole sequence's target count (int64) its division keeps; under
    tensor parallelism also this rank's count (int64), by which it scales the vocab-parallel mean."""
    return 8 if check_int("tp_size", tp_size, 1) == 1 else 16
