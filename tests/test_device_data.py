"""Device choice, seeding, the lab setup call, and the shipped corpus."""

import pytest
import torch

import labkit
from labkit.data import VOCAB_SIZE, batches, decode, encode, get_batch, load_corpus


def test_setup_prints_versions_and_returns_a_device(capsys):
    dev = labkit.setup(seed=3)
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and f"labkit {labkit.__version__}" in out
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert f"device: {dev.type}" in out


def test_seed_everything_makes_runs_repeatable():
    labkit.seed_everything(7)
    a = torch.randn(5)
    labkit.seed_everything(7)
    assert torch.equal(a, torch.randn(5))


def test_pick_device_rejects_unknown_and_unavailable(monkeypatch):
    with pytest.raises(ValueError, match="prefer='tpu'"):
        labkit.pick_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="prefer='cuda'"):
        labkit.pick_device("cuda")
    assert labkit.pick_device().type == "cpu"
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")
    assert labkit.pick_device().type == "cpu"


def test_seed_must_be_non_negative_int():
    with pytest.raises(ValueError, match="seed"):
        labkit.seed_everything(-1)


def test_corpus_is_shipped_and_byte_tokenized():
    tokens = load_corpus()
    assert tokens.dtype == torch.long and len(tokens) > 100_000
    assert int(tokens.max()) < VOCAB_SIZE
    assert decode(tokens[:14]) == "First Citizen:"
    assert torch.equal(encode("naïve"), torch.tensor(list("naïve".encode())))


def test_batches_are_next_token_windows_and_reproducible():
    tokens = load_corpus()
    x, y = next(batches(4, 16, seed=1))
    x2, y2 = next(batches(4, 16, seed=1))
    assert torch.equal(x, x2) and x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    # every window is a real slice of the corpus
    text = decode(tokens)
    assert decode(torch.cat([x[0], y[0, -1:]])) in text


@pytest.mark.parametrize("kwargs, name", [({"batch_size": 0, "seq_len": 8}, "batch_size"),
                                          ({"batch_size": 2, "seq_len": 0}, "seq_len")])
def test_get_batch_bad_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        get_batch(torch.arange(100), **kwargs)
