"""Requests, their sequences, and the choice of each next token: greedy, sampling or beam search.

Parallel sampling (n > 1) and beam search start from one prefilled prompt and fork it; the
forks share the prompt's blocks until one of them writes (copy-on-write, Kwon et al. 2023,
Sec. 4.4). Sample i of a request draws from its own generator seeded ``seed + i``, so it is the
same sequence as a request with n = 1 and that seed. :func:`decide` only decides: it returns
the forks, the drops and the tokens, and the engine applies them to its cache.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from ..validate import check_float, check_int

__all__ = ["Request", "Sequence", "Decision", "decide"]


def token_list(prompt, name: str = "prompt") -> list:
    """Token ids as a list of Python ints; a 1-D integer tensor or array is converted."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
        raise TypeError(f"{name} must be a list of token ids or a 1-D integer tensor, "
                        f"got {type(prompt).__name__}")
    tokens = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    for i, t in enumerate(tokens):  # a float, a bool or a nested row is refused here
        is_bool = "bool" in f"{type(t).__name__} {getattr(t, 'dtype', '')}"
        if not isinstance(t, (bool, int)) and not is_bool:
            try:
                tokens[i] = t = operator.index(t)  # a NumPy or 0-d tensor integer
            except TypeError:
                pass
        check_int(f"{name}[{i}]", t, 0)
    return tokens




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

    def __post_init__(self):
        self.prompt = token_list(self.prompt)

    @property
    def final_len(self) -> int:
        """Slots the request's longest state needs: the last generated token is never fed back."""
        return len(self.prompt) + self.max_new_tokens - 1

    def validate(self, max_len: int, name: str = "request", vocab_size: int | None = None) -> None:
        """Raise ValueError naming ``name``'s first field that cannot be served."""
        if len(self.prompt) < 1:
            raise ValueError(f"{name}.prompt is empty: a request needs at least one token")
        for f in ("max_new_tokens", "n", "beam_width"):
            check_int(f"{name}.{f}", getattr(self, f), 1)
        check_int(f"{name}.arrival", self.arrival, 0)
        check_int(f"{name}.seed", self.seed, 0, 2 ** 64 - max(self.n, 1))  # sample i seeds seed + i < 2^64
        check_float(f"{name}.temperature", self.temperature, 0.0)  # 0: greedy
        if self.n > 1 and self.beam_width > 1:
            raise ValueError(f"{name}: n={self.n} and beam_width={self.beam_width}; choose one")
        if vocab_size is not None and self.beam_width > vocab_size:
            raise ValueError(f"{name}.beam_width={self.beam_width} exceeds vocab_size={vocab_size}: "
                             "the first step has only vocab_size continuations")
        if vocab_size is not None and not 0 <= min(self.prompt) <= max(self.prompt) < vocab_size:
            bad = [x for x in self.prompt if not 0 <= x < vocab_size][0]
            raise ValueError(f"{name}.prompt holds token id {bad}: valid ids are "
                             f"0..{vocab_size - 1}")
        if len(self.prompt) + self.max_new_tokens > max_len:
            raise ValueError(f"{name}: prompt {len(self.prompt)} + max_new_tokens "
                             f"{self.max_new_tokens} exceed max_len={max_len}")

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
        return Sequence(sid, list(self.tokens), self.n_prompt, self.final_len, generator,
                        self.score)


@dataclass
class Decision:
    """One step of a request: cache forks (parent sid, child sid) and drops (sid), to apply in
    that order, then each kept sequence's next token and score."""
    forks: list = field(default_factory=list)
    drops: list = field(default_factory=list)
    next: list = field(default_factory=list)  # (sequence, token, score), in the new order


def _next_token(seq, row, temperature):
    if row is None:  # the engine's accounting runs: no model, every token is 0
        return 0
    if temperature == 0:
        return int(row.argmax())
    probs = torch.softmax(row.cpu().double() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def decide(group, rows, new_sid) -> Decision:
    """Each sequence's next token. rows: one (V,) logits row per sequence, or None (no model)."""
    req, seqs = group.req, list(group.seqs)
    if req.beam_width > 1:
        return _beam_step(req.beam_width, seqs, rows, new_sid)
    out = Decision()
    if group.fresh and req.n > 1:  # parallel sampling: fork the prefilled prompt n - 1 times
        for i in range(1, req.n):
            gen = torch.Generator().manual_seed(req.seed + i) if req.temperature > 0 else None
            seqs.append(seqs[0].fork(new_sid(), gen))
            out.forks.append((seqs[0].sid, seqs[-1].sid))
        rows = None if rows is None else rows * req.n
    for i, s in enumerate(seqs):
        token = _next_token(s, None if rows is None else rows[i], req.temperature)
        out.next.append((s, token, s.score))
    return out


def _beam_step(k, seqs, rows, new_sid) -> Decision:
    """Keep the k best continuations of all beams by summed log-probability."""
    if rows is None:
        picks = [(i % len(seqs), 0, seqs[i % len(seqs)].score) for i in range(k)]
    else:
        logp = torch.stack(rows).log_softmax(dim=-1)  # (beams, V)
        scores = torch.tensor([s.score for s in seqs], dtype=logp.dtype,
                              device=logp.device)[:, None] + logp  # (beams, V)
        top = scores.flatten().topk(k)
        V = logp.size(1)
        picks = [(idx // V, idx % V, val)
                 for val, idx in zip(top.values.tolist(), top.indices.tolist())]
    out, used = Decision(), set()
    for parent, token, score in picks:  # every child before any token: a fork copies the parent
        if parent in used:
            child = seqs[parent].fork(new_sid())
            out.forks.append((seqs[parent].sid, child.sid))
        else:
            used.add(parent)
            child = seqs[parent]
        out.next.append((child, int(token), float(score)))
    out.drops = [s.sid for i, s in enumerate(seqs) if i not in used]
    return out
