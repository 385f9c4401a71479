"""Run labkit's Triton FlashAttention kernels on small shapes and print their errors as JSON.

Used by tests/test_flash_attention.py in a subprocess: on the CPU, TRITON_INTERPRET=1 must be set
before triton is first imported, which a fresh process guarantees. Also reports whether importing
labkit.flash_attention imported triton (it must not).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import labkit.flash_attention as fa  # before triton: this import must not pull it in

triton_at_import = "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read by triton when it is first imported, just below

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(1)
SHAPES = [(37, 37, 16), (19, 45, 24)]  # odd lengths, two head dims; s_q < s_k for the causal alignment
results = []
for dtype in (torch.float32, torch.float16):
    for causal in (False, True):
        for s_q, s_k, d in SHAPES:
            g = torch.Generator().manual_seed(s_q + d)
            # drawn in the dtype, so that the fp64 reference sees the very same inputs
            q, k, v = (torch.randn(2, 2, s, d, generator=g).to(dtype) for s in (s_q, s_k, s_k))
            dout = torch.randn(2, 2, s_q, d, generator=g).to(dtype)
            errors = {}
            for name, dt, dev in (("triton", dtype, device), ("torch", dtype, device), ("fp64", torch.float64, "cpu")):
                xs = [t.to(dev, dt).requires_grad_() for t in (q, k, v)]
                if name == "triton":
                    out, lse = fa.FlashAttentionTriton.apply(*xs, causal)
                else:
                    out, lse = fa.standard_attention(*xs, causal, return_lse=True)
                grads = torch.autograd.grad(out, xs, dout.to(dev, dt))
                errors[name] = [t.detach().cpu().double() for t in (out, lse, *grads)]
            ref = errors.pop("fp64")
            results.append({
                "case": f"{str(dtype)[6:]} causal={causal} s_q={s_q} s_k={s_k} d={d}",
                # max |x - ref| of out, L, dq, dk, dv; and the relative error ||x - ref|| / ||ref||
                "err": {n: [(a - b).abs().max().item() for a, b in zip(v, ref)] for n, v in errors.items()},
                "rel": {n: [((a - b).norm() / b.norm()).item() for a, b in zip(v, ref)]
                        for n, v in errors.items()},
                # the relative rounding of the reference's values to the dtype: the slack of the rule
                "round": [((b.to(dtype).double() - b).norm() / b.norm()).item() for b in ref],
            })

# a loss that uses L too (as a merge of partial attentions does): its gradient flows through L
g = torch.Generator().manual_seed(7)
q, k, v = (torch.randn(1, 2, s, 16, generator=g) for s in (19, 45, 45))
dout, dl = torch.randn(1, 2, 19, 16, generator=g), torch.randn(1, 2, 19, generator=g)
lse_grads = {}
for name, dt, dev in (("triton", torch.float32, device), ("torch", torch.float32, device),
                      ("fp64", torch.float64, "cpu")):
    xs = [t.to(dev, dt).requires_grad_() for t in (q, k, v)]
    if name == "triton":
        out, lse = fa.FlashAttentionTriton.apply(*xs, True)
    else:
        out, lse = fa.standard_attention(*xs, True, return_lse=True)
    loss = (out * dout.to(dev, dt)).sum() + (lse * dl.to(dev, lse.dtype)).sum()
    lse_grads[name] = [t.detach().cpu().double() for t in torch.autograd.grad(loss, xs)]
ref = lse_grads.pop("fp64")
lse_rel = {n: [((a - b).norm() / b.norm()).item() for a, b in zip(v, ref)] for n, v in lse_grads.items()}
lse_rel["round"] = [((b.float().double() - b).norm() / b.norm()).item() for b in ref]


def _sdpa_gqa(q, k, v, causal):
    """PyTorch's attention with each kv head repeated for its group of query heads (no labkit code)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask if causal else None)


# grouped-query attention: 4 query heads on 2 kv heads, in fp32, against SDPA on repeated kv heads
gqa = []
for causal in (False, True):
    g = torch.Generator().manual_seed(11)
    q, dout = torch.randn(1, 4, 19, 16, generator=g), torch.randn(1, 4, 19, 16, generator=g)
    k, v = torch.randn(1, 2, 45, 16, generator=g), torch.randn(1, 2, 45, 16, generator=g)
    runs = {}
    for name, dt, dev in (("triton", torch.float32, device), ("torch", torch.float32, device),
                          ("fp64", torch.float64, "cpu")):
        xs = [t.to(dev, dt).requires_grad_() for t in (q, k, v)]
        out = fa.FlashAttentionTriton.apply(*xs, causal)[0] if name == "triton" else _sdpa_gqa(*xs, causal)
        runs[name] = [t.detach().cpu().double() for t in (out, *torch.autograd.grad(out, xs, dout.to(dev, dt)))]
    ref = runs.pop("fp64")
    gqa.append({"causal": causal, "shapes": [list(t.shape) for t in runs["triton"]],
                "rel": {n: [((a - b).norm() / b.norm()).item() for a, b in zip(x, ref)] for n, x in runs.items()},
                "round": [((b.float().double() - b).norm() / b.norm()).item() for b in ref]})
print(json.dumps({"triton_at_import": triton_at_import, "device": device,
                  "interpreted": os.environ.get("TRITON_INTERPRET") == "1", "results": results,
                  "lse_grad": lse_rel, "gqa": gqa}))
