"""Requests, their sequences, and the choice of each next token: greedy, sampling or beam search.

Parallel sampling (n > 1) and beam search start from one prefilled prompt and fork it; the
forks share the prompt's blocks until one of them writes (copy-on-write, Kwon et al. 2023,
Sec. 4.4). Sample i of a request draws from its own generator seeded ``seed + i``, so it is the
same sequence as a request with n = 1 and that seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Request", "Sequence", "decide"]


@dataclass
class Request:
    """A prompt (token ids), how many tokens to generate, and when it arrives (engine steps)."""
    prompt: list
    max_new_tokens: int
    arrival: int = 0
    n: int = 1
    beam_width: int = 1
    temperature: float = 0.0  # 0: greedy
    seed: int = 0

    @property
    def final_len(self) -> int:
        """Slots the request's longest state needs: the last generated token is never fed back."""
        return len(self.prompt) + self.max_new_tokens - 1

    def validate(self, max_len: int, name: str = "request") -> None:
        if len(self.prompt) < 1:
            raise ValueError(f"{name}.prompt is empty: a request needs at least one token")
        for field in ("max_new_tokens", "n", "beam_width"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{field}={value!r} must be a positive int")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError(f"{name}: n={self.n} and beam_width={self.beam_width}; choose one")
        if len(self.prompt) + self.max_new_tokens > max_len:
            raise ValueError(f"{name}: prompt {len(self.prompt)} + max_new_tokens {self.max_new_tokens} "
                             f"exceed max_len={max_len}")

    def outputs(self, seqs):
        """(generated tokens, scores): a list for n = 1, else one list per sequence (best beam first)."""
        tokens = [s.tokens[s.n_prompt:] for s in seqs]
        if self.beam_width > 1:
            return tokens, [s.score for s in seqs]
        return (tokens if self.n > 1 else tokens[0]), None


@dataclass
class Sequence:
    sid: int
    tokens: list
    n_prompt: int
    final_len: int
    generator: torch.Generator | None = None
    score: float = 0.0  # sum of log-probabilities (beam search)

    @classmethod
    def start(cls, sid, req: Request, index: int = 0) -> "Sequence":
        gen = torch.Generator().manual_seed(req.seed + index) if req.temperature > 0 else None
        return cls(sid, list(req.prompt), len(req.prompt), req.final_len, gen)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    def fork(self, sid, generator=None) -> "Sequence":
        return Sequence(sid, list(self.tokens), self.n_prompt, self.final_len, generator, self.score)


def _next_token(seq, row, temperature):
    if row is None:  # the engine's accounting runs: no model, every token is 0
        return 0
    if temperature == 0:
        return int(row.argmax())
    probs = torch.softmax(row.float().cpu() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def decide(group, rows, cache, new_sid) -> None:
    """Append each sequence's next token. rows: one (V,) logits row per sequence, or None."""
    req, seqs = group.req, group.seqs
    if req.beam_width > 1:
        _beam_step(group, rows, cache, new_sid)
    else:
        if group.fresh and req.n > 1:  # parallel sampling: fork the prefilled prompt n - 1 times
            for i in range(1, req.n):
                gen = torch.Generator().manual_seed(req.seed + i) if req.temperature > 0 else None
                seqs.append(seqs[0].fork(new_sid(), gen))
                cache.fork(seqs[0].sid, seqs[-1].sid)
            rows = None if rows is None else rows * req.n
        for i, s in enumerate(seqs):
            s.tokens.append(_next_token(s, None if rows is None else rows[i], req.temperature))
    group.fresh = False


def _beam_step(group, rows, cache, new_sid):
    """Keep the beam_width best continuations of all beams by summed log-probability."""
    k, seqs = group.req.beam_width, group.seqs
    if rows is None:
        picks = [(i % len(seqs), 0, seqs[i % len(seqs)].score) for i in range(k)]
    else:
        logp = torch.stack(rows).log_softmax(dim=-1)  # (beams, V)
        scores = torch.tensor([s.score for s in seqs], dtype=logp.dtype, device=logp.device)[:, None] + logp
        top = scores.flatten().topk(k)
        V = logp.size(1)
        picks = [(idx // V, idx % V, val) for val, idx in zip(top.values.tolist(), top.indices.tolist())]
    used, beams = set(), []
    for parent, token, score in picks:  # every child first, then the tokens: a fork copies the parent
        if parent in used:
            child = seqs[parent].fork(new_sid())
            cache.fork(seqs[parent].sid, child.sid)
        else:
            used.add(parent)
            child = seqs[parent]
        beams.append((child, token, score))
    for i, s in enumerate(seqs):
        if i not in used:
            cache.free_sequence(s.sid)
    for child, token, score in beams:
        child.tokens.append(int(token))
        child.score = float(score)
    group.seqs[:] = [child for child, _, _ in beams]
