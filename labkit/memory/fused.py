"""The Llama block's activations under production kernels, tensor by tensor (torch-free).

labkit's model computes each operation apart, and autograd keeps what each one saves
(:func:`labkit.memory.analytic.llama_layer_bytes`, exact against the meter). Production stacks
fuse them: Megatron-LM with Transformer Engine and torchtitan keep, per layer and micro-batch,
on one of t ranks (r = t with sequence parallelism, else 1; e bytes an activation; a, n_kv the
rank's heads; f its MLP width):

- each fused RMSNorm: its input (sbh e / r) and its fp32 1/rms (4bs / r), twice;
- the QKV projection: its input, the normalised tensor (sbh e / r: under sequence parallelism
  the shard, gathered again in backward);
- the attention kernel: the rotated q (a hd sb e), k and v as read (2 n_kv hd sb e, no repeat),
  its output O, which is also the output projection's input (a hd sb e), and its fp32
  log-sum-exp (4 a s b); "eager": the softmax output (a s^2 b e) instead of the log-sum-exp;
- the MLP: fc1's input (sbh e / r), fc1's output, gate and up together (2 sbf e), and the fused
  SwiGLU's output, fc2's input (sbf e);
- under selective recomputation the attention core is recomputed: its log-sum-exp (or softmax)
  is not kept, O is (the projection's input); under full, the block's input only (sbh e / r).

``KERNELS``: "labkit" (labkit's count, the meter's) or "fused" (this one, not measured here: no
fused kernel runs on the CPU).
"""

from __future__ import annotations

from ..validate import check_bool, check_choice, check_int

__all__ = ["KERNELS", "fused_llama_layer_bytes"]

KERNELS = ("labkit", "fused")


def fused_llama_layer_bytes(seq_len: int, batch_size: int, d_model: int, n_head: int, n_kv_head: int,
                            d_ff: int, *, dtype_bytes: int = 2, tp_size: int = 1, sequence_parallel: bool = False,
                            recompute: str = "none", attention: str = "flash") -> dict:
    """Bytes one Llama block keeps per rank under fused kernels, by term (the module docstring)."""
    s, b, h, a, kv, f, t = (check_int(n, v, 1) for n, v in (
        ("seq_len", seq_len), ("batch_size", batch_size), ("d_model", d_model), ("n_head", n_head),
        ("n_kv_head", n_kv_head), ("d_ff", d_ff), ("tp_size", tp_size)))
    e = check_choice("dtype_bytes", dtype_bytes, (2, 4))
    r = t if check_bool("sequence_parallel", sequence_parallel) else 1
    check_choice("recompute", recompute, ("none", "selective", "full"))
    check_choice("attention", attention, ("flash", "eager"))
    if recompute == "full":
        return {"block input (sbh e / r)": s * b * h * e // r}
    hd, a, kv, f = h // a, a // t, max(kv // t, 1), f // t
    token = hd * s * b * e  # one head's (b, s, hd) tensor
    terms = {"RMSNorm inputs and 1/rms (2 (sbh e + 4bs) / r)": 2 * (s * b * h * e + 4 * b * s) // r,
             "QKV and fc1 inputs (2 sbh e / r)": 2 * s * b * h * e // r,
             "rotated q (sbh e / t)": a * token,
             "k and v as read (2 n_kv hd sb e / t)": 2 * kv * token,
             "fc1 output, gate and up (2 sbf e / t)": 2 * s * b * f * e,
             "SwiGLU output, fc2 input (sbf e / t)": s * b * f * e,
             "attention output O, the output projection's input (sbh e / t)": a * token}
    if recompute == "none":
        terms.update({"log-sum-exp (4 a s b / t)": 4 * a * s * b} if attention == "flash"
                     else {"softmax output (a s^2 b e / t)": a * s * s * b * e})
    return terms
