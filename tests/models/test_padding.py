"""The padding contract over every registered causal mechanism: a left-padded batch gives, row
by row, the logits of each row alone, at prefill and at every decoding step; what a mechanism
cannot serve that way it refuses."""

import pytest
import torch
from conftest import registered

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError
from memattn.layers import get_mechanism
from memattn.models import CausalLM

# each with its registration's test options: windows, pools, global tokens and slots small
# enough to see the positions
CAUSAL = registered("causal")


def small(name, positions):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=31, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=64,
                      positions=positions, attention=AttentionConfig(name, get_mechanism(name).test_options))
    return CausalLM(cfg).double().eval()


def padded_batch(rows, pad=31):
    """Rows padded on the left by `pad`, by default an id past the vocabulary (never read)."""
    width = max(len(r) for r in rows)
    idx = torch.stack([torch.cat([torch.full((width - len(r),), pad), r]) for r in rows])
    mask = torch.stack([torch.arange(width) >= width - len(r) for r in rows])
    return idx, mask


def decode(model, idx, mask, steps):
    """Last-position logits after the masked prefill and after each decoding step: [B, 1 + n, V]."""
    cache = model.init_cache(idx.shape[0])
    out = [model(idx, cache=cache, attention_mask=mask)[:, -1]]
    for t in range(steps.shape[1]):
        out.append(model(steps[:, t:t + 1], cache=cache,
                         attention_mask=torch.ones(len(idx), 1, dtype=torch.bool))[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("positions", ["rotary", "learned"])
@pytest.mark.parametrize("name", CAUSAL)
def test_left_padded_rows_decode_as_each_row_alone(name, positions):
    model = small(name, positions)
    rows = [torch.randint(1, 31, (n,)) for n in (11, 6, 9)]  # padded by 0, 5 and 2
    idx, mask = padded_batch(rows)
    steps = torch.randint(1, 31, (3, 5))
    if not get_mechanism(name).left_padding:  # declared: some padding is refused, saying how to pad
        with pytest.raises(ConfigError, match="left-pad"):
            decode(model, idx, mask, steps)
        return
    full = model(idx, attention_mask=mask)
    assert torch.isfinite(full).all()  # padding's own outputs are defined too
    got = decode(model, idx, mask, steps)
    for r, row in enumerate(rows):
        alone = model(torch.cat([row, steps[r]])[None])[0]
        torch.testing.assert_close(full[r, mask[r]], alone[:len(row)], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got[r], alone[len(row) - 1:], rtol=1e-9, atol=1e-9)


def test_dilated_queue_takes_padding_by_multiples_of_the_dilation():
    model = small("abc-dilated", "rotary")
    rows = [torch.randint(1, 31, (n,)) for n in (10, 7, 4)]  # padded by 0, 3 and 6
    idx, mask = padded_batch(rows)
    steps = torch.randint(1, 31, (3, 4))
    got = decode(model, idx, mask, steps)
    for r, row in enumerate(rows):
        alone = model(torch.cat([row, steps[r]])[None])[0]
        torch.testing.assert_close(got[r], alone[len(row) - 1:], rtol=1e-9, atol=1e-9)


def test_cluster_slots_without_members_average_real_tokens_only():
    model = small("abc-cluster", "rotary")
    row = torch.randint(1, 31, (5,))
    idx, mask = padded_batch([row, torch.randint(1, 31, (12,))])
    torch.testing.assert_close(model(idx, attention_mask=mask)[0, mask[0]], model(row[None])[0],
                               rtol=1e-9, atol=1e-9)
