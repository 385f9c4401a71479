"""Synthetic request traces whose prompt and output lengths follow published dataset statistics.

Kwon et al. (2023, Sec. 6.1 and Fig. 11) serve traces built from ShareGPT and Alpaca; their
Fig. 11 gives the mean lengths used here: ShareGPT 161.31 input and 337.99 output tokens,
Alpaca 19.31 and 58.45 (ShareGPT's are 8.4x and 5.8x longer, as their text says). Those
datasets cannot be downloaded here, so lengths are drawn from a log-normal distribution with
those means. The log-normal shape and its sigma are our assumption (the figure shows long
right tails); arrivals are a Poisson process, as in the paper. Everything is seeded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..validate import check_float, check_int, check_positive
from .sampling import Request

__all__ = ["LengthDistribution", "SHAREGPT", "ALPACA", "synthetic_trace"]


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal prompt and output lengths with the given means (tokens)."""
    name: str
    mean_prompt: float
    mean_output: float
    sigma: float = 1.0

    def __post_init__(self):
        check_positive("mean_prompt", self.mean_prompt)
        check_positive("mean_output", self.mean_output)
        check_float("sigma", self.sigma, 0.0)

    def draw(self, rng, size, scale=1.0):
        """(prompt lengths, output lengths), ints >= 1, means scaled by ``scale``."""
        def lognormal(mean):
            mu = math.log(mean * scale) - self.sigma ** 2 / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2/2)
            return np.maximum(1, np.rint(rng.lognormal(mu, self.sigma, size))).astype(int)
        return lognormal(self.mean_prompt), lognormal(self.mean_output)


SHAREGPT = LengthDistribution("ShareGPT", 161.31, 337.99)  # Kwon et al. 2023, Fig. 11a
ALPACA = LengthDistribution("Alpaca", 19.31, 58.45)  # Kwon et al. 2023, Fig. 11b


def synthetic_trace(num_requests, dist=SHAREGPT, *, max_len, rate=None, scale=1.0, vocab_size=256, seed=0):
    """``num_requests`` requests with lengths from ``dist`` (means times ``scale``), clipped so that
    prompt + output <= ``max_len``, arriving as a Poisson process of ``rate`` requests per engine
    step (all at step 0 when ``rate`` is None). Prompt tokens are uniform in [0, vocab_size)."""
    check_int("num_requests", num_requests, 1)
    check_int("max_len", max_len, 2)
    check_int("vocab_size", vocab_size, 1)
    check_int("seed", seed, 0)
    if not isinstance(dist, LengthDistribution):
        raise TypeError(f"dist={dist!r} must be a LengthDistribution (SHAREGPT, ALPACA or your own)")
    if rate is not None:
        check_positive("rate", rate)  # requests per step
    check_positive("scale", scale)
    rng = np.random.default_rng(seed)
    prompts, outputs = dist.draw(rng, num_requests, scale)
    prompts = np.minimum(prompts, max_len - 1)
    outputs = np.minimum(outputs, max_len - prompts)
    if rate is None:
        arrivals = np.zeros(num_requests, dtype=int)
    else:
        arrivals = np.floor(np.cumsum(rng.exponential(1.0 / rate, num_requests))).astype(int)
    return [Request(prompt=rng.integers(0, vocab_size, int(p)).tolist(), max_new_tokens=int(o),
                    arrival=int(a)) for p, o, a in zip(prompts, outputs, arrivals)]
