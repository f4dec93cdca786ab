"""research.experiments.gmat_majority: chaining a MAJORITY(512, 1) model to longer
sequences, and the curriculum settings."""

from __future__ import annotations

import pytest
import torch

from memattn.errors import ConfigError
from memattn.typed import parse_settings
from research.experiments.gmat_majority import Settings, build_model, start_from


def test_chaining_copies_the_trained_block_row_to_every_new_block():
    s = Settings(d_model=16, n_heads=2)
    short, long = build_model(512, 8, 64, s, 0.02), build_model(2048, 8, 256, s, 0.02)
    start_from(long, short)
    high = long.pos.high.weight
    assert high.shape[0] == 4 and torch.equal(high, short.pos.high.weight.expand(4, -1))
    assert torch.equal(long.pos.low.weight, short.pos.low.weight)
    assert torch.equal(long.memory.weight, short.memory.weight)


def test_curriculum_shares_are_checked():
    s = parse_settings(Settings, ["wide_phase=0.25", "segment_steps=10"], name="gmat-majority")
    assert (s.wide_phase, s.segment_steps) == (0.25, 10)
    with pytest.raises(ConfigError, match=r"long_wide_phase: expected a share in \[0, 1\], got 1.5"):
        parse_settings(Settings, ["long_wide_phase=1.5"], name="gmat-majority")
