"""The encoder-decoder: incremental decoding, fixed-size memories, and it learns to reverse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import registered

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ShapeError
from memattn.layers import get_mechanism
from memattn.models import EncoderDecoder
from memattn.models.seq2seq import memory_nbytes


def model(name="abc-mlp", positions="rotary", cross=None, **options):
    cfg = ModelConfig(vocab_size=12, d_model=32, n_layers=2, n_heads=4, max_len=64,
                      positions=positions, attention=AttentionConfig(name, options),
                      cross_attention=cross)
    return EncoderDecoder(cfg)


@pytest.mark.parametrize("name,options,cross", [
    ("abc-mlp", {"num_slots": 5, "cross_slots": 3}, None), ("softmax", {}, None),
    ("linear", {}, AttentionConfig("softmax")),
    ("abc-window", {"window": 3}, AttentionConfig("abc-mlp", {"cross_slots": 4}))])
def test_decoding_step_by_step_equals_the_full_forward(name, options, cross):
    m = model(name, cross=cross, **options).double().eval()
    src, tgt = torch.randint(0, 12, (2, 9)), torch.randint(0, 12, (2, 7))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 7:] = False
    full = m(src, tgt, src_mask=mask)
    memories = m.encode(src, mask)
    cache = m.init_cache(2)
    steps = [m.decode(tgt[:, :3], memories, cache=cache)]
    steps += [m.decode(tgt[:, t:t + 1], memories, cache=cache) for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)


def test_abc_self_and_cross_memories_have_their_own_sizes_and_do_not_grow():
    m = model(num_slots=5, cross_slots=3).eval()
    short, long = (m.encode(torch.randint(0, 12, (1, n))) for n in (4, 60))
    assert memory_nbytes(short) == memory_nbytes(long)
    assert all(mem.k.shape[2] == 3 for mem in long)  # cross: cross_slots
    cache = m.init_cache(1)
    assert all(state.inner.k.shape[2] == 5 for state in cache.states)  # self: num_slots
    soft = model("softmax").eval()
    assert memory_nbytes(soft.encode(torch.randint(0, 12, (1, 60)))) > \
        memory_nbytes(soft.encode(torch.randint(0, 12, (1, 4))))


def test_wrong_number_of_memories_is_a_clear_error():
    m = model()
    memories = m.encode(torch.randint(0, 12, (1, 5)))
    with pytest.raises(ShapeError, match="memories"):
        m.decode(torch.randint(0, 12, (1, 3)), memories[:1])


@pytest.mark.slow
def test_abc_encoder_decoder_learns_to_reverse_a_sequence():
    """Tokens 2..11 in, the same reversed out (1 = BOS), through a 16-slot cross memory.

    Learned absolute positions: the cross memory is a set, so the source positions must be
    in the encoder's output (rotary positions are only relative).
    """
    torch.manual_seed(0)
    m = model(positions="learned", num_slots=8, cross_slots=16)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)

    def batch(n):
        src = torch.randint(2, 12, (n, 6), generator=gen)
        tgt = src.flip(1)
        return src, torch.cat((torch.ones(n, 1, dtype=torch.long), tgt[:, :-1]), 1), tgt

    for _ in range(400):
        src, tgt_in, tgt = batch(32)
        loss = F.cross_entropy(m(src, tgt_in).flatten(0, 1), tgt.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    src, _, tgt = batch(200)
    out = m.generate(src, bos=1, max_new_tokens=6)
    accuracy = (out == tgt).float().mean().item()
    assert accuracy > 0.95, accuracy


@pytest.mark.parametrize("name", registered("cross"))
def test_every_cross_mechanism_decodes_as_the_full_pass_and_ignores_source_padding(name):
    """With a softmax encoder and a bounded decoder (abc-mlp), each cross mechanism from the
    registry with its test options: token-by-token decoding equals the full forward pass, and
    a source padded on the left decodes as the same source alone."""
    options = get_mechanism(name).test_options
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=12, d_model=32, n_layers=2, n_heads=4, max_len=64,
                      attention=AttentionConfig("abc-mlp", {"num_slots": 4}),
                      cross_attention=AttentionConfig(name, options),
                      encoder_attention=AttentionConfig("softmax"))
    m = EncoderDecoder(cfg).double().eval()
    assert type(m.encoder.blocks[0].attn).__name__ == "SoftmaxAttention"
    src, tgt = torch.randint(0, 12, (2, 9)), torch.randint(0, 12, (2, 7))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    full = m(src, tgt, src_mask=mask)
    memories = m.encode(src, mask)
    cache = m.init_cache(2)
    steps = [m.decode(tgt[:, t:t + 1], memories, cache=cache) for t in range(7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)
    alone = m(src[:1, 3:], tgt[:1])
    torch.testing.assert_close(full[:1], alone, rtol=1e-9, atol=1e-9)
