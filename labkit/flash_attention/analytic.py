"""HBM accesses and FLOPs of attention, per (batch, head), for the algorithms as built (Chapter 7).

Theorem 2 of Dao et al. (2022): standard attention moves Theta(N d + N^2) elements between HBM and
the chip, FlashAttention Theta(N^2 d^2 / M) with M elements of on-chip memory. The constants here
are those of the code: standard attention is Algorithm 0 (write S, read S, write P, read P) and
its backward Algorithm 3; FlashAttention is FlashAttention-2's Algorithms 1 and 2 as
:mod:`labkit.flash_attention.tiled` runs them, with Br = Bc = B, the largest tile for which Q_i,
K_j, V_j, O_i (d columns each) and S_ij fit in M together (:func:`flash_block_size`). Non-causal;
FLOPs count the matrix products (2 per multiply-add).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_choice, check_int

__all__ = ["AttentionCost", "attention_flops", "flash_block_size", "hbm_accesses"]


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


def _positive_int(name, value):
    check_int(name, value, minimum=1)


def flash_block_size(d: int, M: int) -> int:
    """Br = Bc = B, the largest with 4 B d + B^2 <= M: the tiles Q_i, K_j, V_j, O_i (B x d each)
    and S_ij (B x B, overwritten by P_ij) fit in M elements together."""
    _positive_int("d", d)
    _positive_int("M", M)
    if M < 4 * d + 1:
        raise ValueError(f"M={M} elements of on-chip memory must hold a tile of one row: M >= {4 * d + 1}")
    B = int(((2 * d) ** 2 + M) ** 0.5) - 2 * d  # the root of B^2 + 4 d B = M, then fixed up exactly
    while B * B + 4 * d * B > M:
        B -= 1
    while (B + 1) ** 2 + 4 * d * (B + 1) <= M:
        B += 1
    return B


def attention_flops(N: int, d: int, kind: str = "standard", s_k: int | None = None) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of one head with N queries and s_k (default N) keys.

    Forward S = Q Kᵀ and O = P V: 4 N s_k d. Backward dV, dP, dQ, dK: 8 N s_k d; FlashAttention
    also recomputes S: 10 N s_k d.
    """
    _positive_int("N", N)
    _positive_int("d", d)
    s_k = N if s_k is None else s_k
    _positive_int("s_k", s_k)
    check_choice("kind", kind, ("standard", "flash"))
    return 4 * N * s_k * d, (8 if kind == "standard" else 10) * N * s_k * d


def hbm_accesses(N: int, d: int, M: int | None = None, kind: str = "standard") -> AttentionCost:
    """HBM elements moved by one head of self-attention over N tokens, and its FLOPs.

    standard: forward 4 N^2 + 4 N d, backward 7 N^2 + 8 N d (M is not used).
    flash, with B = flash_block_size(d, M) and T = ceil(N / B) blocks:
      forward  N d (Q) + 2 N d T (K, V per row block) + N d + N (O, L)
      backward 2 N d + N (D) + N d (dQ = 0) + 4 N d (K, V, dK, dV) + T (4 N d + 2 N)
               (per key block: Q, dO, L, D read, dQ read and written).
    """
    _positive_int("N", N)
    _positive_int("d", d)
    check_choice("kind", kind, ("standard", "flash"))
    flops = attention_flops(N, d, kind)
    if kind == "standard":
        # Algorithm 0: read Q, K, write S; read S, write P; read P, V, write O.
        fwd = (2 * N * d + N * N) + (N * N + N * N) + (N * N + N * d + N * d)
        # Algorithm 3: dV = Pᵀ dO; dP = dO Vᵀ; dS = P o (dP - D); dQ = dS K; dK = dSᵀ Q.
        bwd = (N * N + 2 * N * d) + (2 * N * d + N * N) + 3 * N * N + 2 * (N * N + 2 * N * d)
        return AttentionCost(fwd, bwd, *flops)
    if M is None:
        raise ValueError("kind='flash' needs M, the on-chip memory in elements")
    T = -(-N // flash_block_size(d, M))  # ceil
    fwd = N * d + 2 * N * d * T + N * d + N
    bwd = (2 * N * d + N) + N * d + 4 * N * d + T * (4 * N * d + 2 * N)
    return AttentionCost(fwd, bwd, *flops)
