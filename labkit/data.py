"""The training corpus shipped with labkit, a byte-level tokenizer and a batch loader.

The corpus is an excerpt (about 200 kB) of Shakespeare's plays, which are in the public
domain. Tokens are bytes, so ``vocab_size`` is 256 and no tokenizer is downloaded.
``check_ids`` and ``check_targets`` are the checks the model makes on a batch it is given.
"""

from __future__ import annotations

from importlib import resources

import torch
from torch._subclasses.fake_tensor import is_fake

from .validate import ArgumentError, check_int

__all__ = ["VOCAB_SIZE", "IGNORE_INDEX", "load_corpus", "encode", "decode", "get_batch", "batches",
           "get_padded_batch", "check_ids", "check_targets"]

VOCAB_SIZE = 256
IGNORE_INDEX = -100  # a target that is no token (padding): F.cross_entropy's ignore_index


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor of token ids in [0, 256)."""
    if not isinstance(text, str):
        raise ArgumentError(f"text={type(text).__name__} must be a str (decode() turns ids back into text)")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens) -> str:
    """Inverse of :func:`encode` (invalid byte sequences are replaced)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def load_corpus() -> torch.Tensor:
    """The shipped corpus as a 1-D int64 tensor of byte tokens."""
    text = resources.files("labkit").joinpath("corpus/shakespeare.txt").read_text(encoding="utf-8")
    return encode(text)


def get_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator | None = None,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the corpus: inputs x (B, T) and next-token targets y (B, T)."""
    _check_tokens(tokens)
    check_int("batch_size", batch_size, 1)
    check_int("seq_len", seq_len, 1, len(tokens) - 1)  # a window needs one more token for y
    starts = torch.randint(len(tokens) - seq_len, (batch_size,), generator=generator)  # (B,)
    offsets = torch.arange(seq_len)  # (T,)
    x = tokens[starts[:, None] + offsets]  # (B, T)
    y = tokens[starts[:, None] + offsets + 1]  # (B, T)
    return x.to(device), y.to(device)


def _check_tokens(tokens) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point() \
            or tokens.is_complex() or tokens.dtype == torch.bool or len(tokens) < 2:
        what = (f"a {tokens.dim()}-D {tokens.dtype} tensor" if isinstance(tokens, torch.Tensor)
                else type(tokens).__name__)
        raise ArgumentError(f"tokens={what} must be a 1-D integer tensor of at least 2 token ids "
                            "(labkit.data.load_corpus() or encode(text))")


def batches(batch_size: int, seq_len: int, seed: int = 0, device: str | torch.device = "cpu",
            tokens: torch.Tensor | None = None):
    """An endless, reproducible stream of (x, y) batches from the shipped corpus."""
    tokens = load_corpus() if tokens is None else tokens
    _check_tokens(tokens)
    check_int("batch_size", batch_size, 1)
    check_int("seq_len", seq_len, 1, len(tokens) - 1)
    gen = torch.Generator().manual_seed(check_int("seed", seed, 0, 2**64 - 1))
    while True:
        yield get_batch(tokens, batch_size, seq_len, generator=gen, device=device)


def get_padded_batch(tokens: torch.Tensor, lengths, seq_len: int | None = None,
                     generator: torch.Generator | None = None, device: str | torch.device = "cpu",
                     pad_id: int = 0, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of the corpus of the given real ``lengths``, right-padded to T = ``seq_len`` (or max).

    Returns x (B, T) with ``pad_id`` after each sequence and targets y (B, T) with
    ``ignore_index`` there, so a loss over y != ignore_index counts real tokens only.
    """
    _check_tokens(tokens)
    lengths = [int(n) if isinstance(n, torch.Tensor) and n.dim() == 0 and not n.is_floating_point()
               else n for n in lengths]  # a tensor of lengths gives 0-d tensors
    if not lengths:
        raise ArgumentError("lengths=[] must name at least one sequence length")
    check_int("pad_id", pad_id, 0)
    check_int("ignore_index", ignore_index, -(2**63))
    for i, n in enumerate(lengths):  # each row has a real target: no row is all ignore_index
        check_int(f"lengths[{i}]", n, 1)
    T = check_int("seq_len", max(lengths) if seq_len is None else seq_len, 1, len(tokens) - 1)
    if max(lengths) > T:
        raise ArgumentError(f"lengths={lengths} must each be in [1, seq_len={T}]")
    x, y = get_batch(tokens, len(lengths), T, generator=generator)  # (B, T), (B, T)
    real = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) bool
    x = x.masked_fill(~real, pad_id)
    y = y.masked_fill(~real, ignore_index)
    return x.to(device), y.to(device)


# -- the checks the model makes on a batch --------------------------------------------------

def _values_are_free(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values costs nothing: a real CPU tensor, outside torch.compile.

    On a GPU, reading a value back makes every step wait for the device (a hidden sync), so
    there the ids are left to the batch maker (these functions yield only valid ones) and to the
    kernels' own device-side asserts; fake and meta tensors hold no values at all.
    """
    return (t.device.type == "cpu" and t.numel() > 0 and not is_fake(t)
            and not torch.compiler.is_compiling())


def _check_index_tensor(name: str, t, ndim: int | None, what: str,
                        dtypes=(torch.long, torch.int)) -> None:
    if (not isinstance(t, torch.Tensor) or t.dtype not in dtypes
            or (ndim is not None and t.dim() != ndim)):
        shape = "" if ndim is None else f"{ndim}-D "
        got = f"a {t.dim()}-D {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ArgumentError(f"{name}={got} must be a {shape}int64 tensor of {what}s")


def check_ids(name: str, t, high: int, *, ndim: int | None = 2, what: str = "token id",
              bound: str = "vocab_size") -> None:
    """Raise unless ``t`` is an integer tensor (of ``ndim`` dims) with values in [0, ``high``).

    The type and shape are always checked; the values where that is free (on the CPU)."""
    _check_index_tensor(name, t, ndim, what)
    if _values_are_free(t):
        lo, hi = (int(v) for v in t.aminmax())
        if lo < 0 or hi >= high:
            raise ArgumentError(f"{what} {lo if lo < 0 else hi} is outside [0, {bound}={high})")


def check_targets(targets, logits: torch.Tensor) -> None:
    """Raise unless ``targets`` (B, T) fit ``logits`` (B, T, V): ids in [0, V) or IGNORE_INDEX.

    Where the values are free to read (the CPU), a batch whose every target is IGNORE_INDEX is
    refused too: its mean loss is over no tokens (torch returns nan without a word)."""
    _check_index_tensor("targets", targets, 2, "target", (torch.long,))  # as F.cross_entropy
    if logits.shape[:-1] != targets.shape:
        raise ArgumentError(f"targets of shape {tuple(targets.shape)} must match the logits' "
                            f"(B, T) = {tuple(logits.shape[:-1])}")
    if not _values_are_free(targets):
        return
    real = targets[targets != IGNORE_INDEX]
    if real.numel() == 0:
        raise ArgumentError(f"every target is {IGNORE_INDEX} (ignored): the mean loss over no tokens "
                            "is undefined; give at least one real target (labkit.data's batches do)")
    lo, hi = (int(v) for v in real.aminmax())
    if lo < 0 or hi >= logits.size(-1):
        raise ArgumentError(f"target {lo if lo < 0 else hi} is outside [0, vocab_size={logits.size(-1)}); "
                            f"mark positions that have no target with {IGNORE_INDEX} "
                            "(F.cross_entropy's ignore_index)")
