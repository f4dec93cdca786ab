"""memattn.models.Encoder: bidirectional attention, padding, heads."""

import pytest
import torch
from conftest import registered

from memattn.config import AttentionConfig, ModelConfig
from memattn.models import Encoder

BIDIRECTIONAL = registered("bidirectional")  # at their default options, which reach 12 tokens


def encoder(name="softmax", n_tags=0):
    cfg = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=64,
                      attention=AttentionConfig(name))
    return Encoder(cfg, n_tags=n_tags).double().eval()


@pytest.mark.parametrize("name", BIDIRECTIONAL)
def test_every_token_sees_the_whole_sequence(name):
    model = encoder(name)
    idx = torch.randint(0, 29, (1, 12))
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 29
    assert not torch.allclose(model(idx)[:, 0], model(changed)[:, 0])


@pytest.mark.parametrize("name", BIDIRECTIONAL)
def test_padding_does_not_reach_real_tokens(name):
    model = encoder(name)
    idx = torch.randint(0, 29, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    out = model(idx, attention_mask=mask)
    other = idx.clone()
    other[1, 7:] = torch.tensor([3, 29, 1000])  # change only the padding: ids past the vocabulary too
    torch.testing.assert_close(model(other, attention_mask=mask)[1, :7], out[1, :7])
    torch.testing.assert_close(out[1, :7], model(idx[1:, :7])[0])  # as if the padding were absent


def test_heads_have_the_right_shapes():
    model = encoder(n_tags=3)
    h = model(torch.randint(0, 29, (2, 5)))
    assert model.mlm_logits(h).shape == (2, 5, 29) and model.tag_logits(h).shape == (2, 5, 3)
    with pytest.raises(ValueError, match="n_tags=0"):
        encoder().tag_logits(h)
