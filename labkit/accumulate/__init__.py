"""Gradient accumulation (Chapter 4): one large batch as k micro-batches and one optimizer step.

``window``: the window-normalised loss, exact for token losses of any lengths, beside the naive
mean per micro-batch (the 2024 bug); ``ddp``: the window under data parallelism, all-reduced
once (``no_sync``) or every micro-step; ``budget``: the micro-batch for a memory budget, from
measured peaks; ``analytic``: the loss scales, the naive token weights, k = ceil(B / b).
Padding is marked in the targets by ``ignore_index`` (default -100); a caller who pads with
another value must pass it, or the padding counts as real tokens.
"""

from .analytic import naive_loss_scales, naive_token_weights, num_microbatches, window_loss_scales
from .budget import measure_microbatch, microbatch_for_budget
from .ddp import accumulate_gradients_ddp, accumulate_gradients_ddp_naive, global_token_count
from .window import (IGNORE_INDEX, accumulate_gradients, accumulate_gradients_naive, accumulation_step,
                     accumulation_step_naive, count_tokens, split_microbatches, token_loss_sum)

__all__ = [
    "IGNORE_INDEX", "split_microbatches", "count_tokens", "token_loss_sum",
    "accumulate_gradients", "accumulate_gradients_naive", "accumulation_step", "accumulation_step_naive",
    "global_token_count", "accumulate_gradients_ddp", "accumulate_gradients_ddp_naive",
    "measure_microbatch", "microbatch_for_budget",
    "window_loss_scales", "naive_loss_scales", "naive_token_weights", "num_microbatches",
]
