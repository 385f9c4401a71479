"""HBM accesses and FLOPs of attention, per (batch, head), for the algorithms as built (Chapter 7).

Theorem 2 of Dao et al. (2022): standard attention moves Theta(N d + N^2) elements between HBM and
the chip, FlashAttention Theta(N^2 d^2 / M) with M elements of on-chip memory. Standard attention
is Algorithm 0 (write S, read S, write P, read P) and its backward Algorithm 3; FlashAttention is
FlashAttention-2's Algorithms 1 and 2 as :mod:`labkit.flash_attention.tiled` runs them. Tiles:
``"paper"`` (the default) is Theorem 2's choice, B_c = ceil(M / 4d) for the block held through
the inner loop and B_r = min(B_c, d) for the blocks streamed past it (:func:`paper_block_sizes`);
``"square"`` is Br = Bc = B, the largest B with 4 B d + B^2 <= M (:func:`flash_block_size`).
Non-causal; FLOPs count the matrix products (2 per multiply-add).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_choice, check_int

__all__ = ["TILES", "AttentionCost", "attention_flops", "flash_block_size", "hbm_accesses",
           "paper_block_sizes"]

TILES = ("paper", "square")


@dataclass(frozen=True)
class AttentionCost:
    """Elements read plus written in HBM, and matmul FLOPs, of one (batch, head) of attention."""

    forward: int
    backward: int
    flops_forward: int
    flops_backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def flash_block_size(d: int, M: int) -> int:
    """Br = Bc = B, the largest with 4 B d + B^2 <= M: the tiles Q_i, K_j, V_j, O_i (B x d each)
    and S_ij (B x B, overwritten by P_ij) fit in M elements together."""
    check_int("d", d, minimum=1)
    check_int("M", M, minimum=1)
    if M < 4 * d + 1:
        raise ValueError(f"M={M} elements of on-chip memory must hold a tile of one row: M >= {4 * d + 1}")
    B = int(((2 * d) ** 2 + M) ** 0.5) - 2 * d  # the root of B^2 + 4 d B = M, then fixed up exactly
    while B * B + 4 * d * B > M:
        B -= 1
    while (B + 1) ** 2 + 4 * d * (B + 1) <= M:
        B += 1
    return B


def paper_block_sizes(d: int, M: int) -> tuple[int, int]:
    """(B_c, B_r) of Theorem 2 (Dao et al. 2022): B_c = ceil(M / 4d), B_r = min(B_c, d).

    B_c rows are held on chip through the inner loop (K_j, V_j in the paper's Algorithm 1 and in
    FlashAttention-2's backward; Q_i and O_i in FlashAttention-2's forward), B_r rows stream past.
    Held, streamed and S_ij (B_r x B_c) take at most about 5M/4 elements: O(M), as the proof needs.
    """
    check_int("d", d, minimum=1)
    check_int("M", M, minimum=1)
    if M < d:
        raise ValueError(f"M={M} elements of on-chip memory must hold one row of d={d}: Theorem 2 "
                         "assumes d <= M")
    B_c = -(-M // (4 * d))  # ceil
    return B_c, min(B_c, d)


def attention_flops(N: int, d: int, kind: str = "standard", s_k: int | None = None) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of one head with N queries and s_k (default N) keys.

    Forward S = Q Kᵀ and O = P V: 4 N s_k d. Backward dV, dP, dQ, dK: 8 N s_k d; FlashAttention
    also recomputes S: 10 N s_k d.
    """
    check_int("N", N, minimum=1)
    check_int("d", d, minimum=1)
    s_k = N if s_k is None else s_k
    check_int("s_k", s_k, minimum=1)
    check_choice("kind", kind, ("standard", "flash"))
    return 4 * N * s_k * d, (8 if kind == "standard" else 10) * N * s_k * d


def hbm_accesses(N: int, d: int, M: int | None = None, kind: str = "standard",
                 tiles: str = "paper") -> AttentionCost:
    """HBM elements moved by one head of self-attention over N tokens, and its FLOPs.

    standard: forward 4 N^2 + 4 N d, backward 7 N^2 + 8 N d (M and tiles are not used).
    flash: B rows held on chip per outer iteration (B_c of ``tiles="paper"``, B of ``"square"``),
    T = ceil(N / B) outer blocks in each pass:
      forward  N d (Q) + 2 N d T (K, V per row block) + N d + N (O, L)
      backward 2 N d + N (D) + N d (dQ = 0) + 4 N d (K, V, dK, dV) + T (4 N d + 2 N)
               (per key block: Q, dO, L, D read, dQ read and written).
    """
    check_int("N", N, minimum=1)
    check_int("d", d, minimum=1)
    check_choice("kind", kind, ("standard", "flash"))
    check_choice("tiles", tiles, TILES)
    flops = attention_flops(N, d, kind)
    if kind == "standard":
        # Algorithm 0: read Q, K, write S; read S, write P; read P, V, write O.
        fwd = (2 * N * d + N * N) + (N * N + N * N) + (N * N + N * d + N * d)
        # Algorithm 3: dV = Pᵀ dO; dP = dO Vᵀ; dS = P o (dP - D); dQ = dS K; dK = dSᵀ Q.
        bwd = (N * N + 2 * N * d) + (2 * N * d + N * N) + 3 * N * N + 2 * (N * N + 2 * N * d)
        return AttentionCost(fwd, bwd, *flops)
    if M is None:
        raise ValueError("kind='flash' needs M, the on-chip memory in elements")
    # the streamed block's size changes what fits, not what moves: only the held block counts
    B = paper_block_sizes(d, M)[0] if tiles == "paper" else flash_block_size(d, M)
    T = -(-N // B)  # ceil
    fwd = N * d + 2 * N * d * T + N * d + N
    bwd = (2 * N * d + N) + N * d + 4 * N * d + T * (4 * N * d + 2 * N)
    return AttentionCost(fwd, bwd, *flops)
