"""Bad input to the model says what is wrong, before an IndexError deep inside an embedding."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from labkit.model import build_model, get_preset

CFG = get_preset("tiny", n_layer=1)


@pytest.mark.parametrize("bad, shown", [(CFG.vocab_size, CFG.vocab_size), (-1, -1)])
def test_a_token_id_outside_the_vocabulary_is_refused(bad, shown):
    model = build_model(CFG)
    idx = torch.zeros(2, 8, dtype=torch.long)
    idx[1, 3] = bad
    with pytest.raises(ValueError, match=rf"token id {shown} is outside \[0, vocab_size={CFG.vocab_size}\)"):
        model(idx)
    idx[1, 3] = CFG.vocab_size - 1  # the largest valid id passes
    assert model(idx).shape == (2, 8, CFG.vocab_size)


def test_fake_and_meta_tensors_skip_the_check_they_cannot_make():
    with FakeTensorMode():  # Lab 1's 7B step: nothing allocated, no values to compare
        logits = build_model(CFG)(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, CFG.vocab_size)
    meta = build_model(CFG, device="meta")
    assert meta(torch.zeros(2, 8, dtype=torch.long, device="meta")).is_meta
