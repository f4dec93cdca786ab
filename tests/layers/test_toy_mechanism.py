"""A mechanism registered from a module of its own (memattn.layers.register) joins everything
that reads the registry: `memattn info --mechanisms`, the generic model tests, the
benchmarks, the experiments, the converter and cross attention; unregistered, it leaves the
registry as it was."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memattn.cli import main
from memattn.layers import LayerSpec, get_mechanism, mechanisms, unregister
from memattn.layers.cross import build_cross_attention, cross_mechanisms

NAME = "toy-mean"
MODULE = "toy_mean_mechanism"
TESTS = Path(__file__).resolve().parents[1]

# Each token reads the mean of the values of the real tokens so far (of the whole sequence in
# an encoder): a memory of one slot, decoded with a running sum and count.
SOURCE = f'''
    from dataclasses import dataclass
    from typing import NamedTuple

    import torch

    from memattn.layers.base import AttentionLayer, AttentionState, Cross, StateSize, register
    from memattn.layers.cross import CrossLayer


    @dataclass
    class MeanOptions:
        bias: bool = False


    class MeanState(AttentionState):
        fixed_size = True

        def __init__(self):
            self.seen = 0
            self.total = None  # [B, H, D]: the sum of the real tokens' values
            self.count = None  # [B, 1, 1]: the real tokens

        def tensors(self):
            return [] if self.total is None else [self.total, self.count]

        def map_tensors(self, fn):
            if self.total is not None:
                self.total, self.count = fn(self.total, True), fn(self.count, True)


    class SourceMean(NamedTuple):
        mean: torch.Tensor  # [B, H, D]


    class MeanCross(CrossLayer):
        def memory(self, src, src_mask=None):
            _, v = self.source_kv(src, src_mask)
            real = torch.ones(v.shape[:2], dtype=v.dtype) if src_mask is None else src_mask.to(v.dtype)
            real = real[:, :, None, None]
            return SourceMean((v * real).sum(1) / real.sum(1).clamp_min(1))

        def forward(self, x, memory):
            q = self.query(x, memory.mean.shape[0])
            return self.finish(memory.mean[:, None].expand_as(q))


    @register("{NAME}", options=MeanOptions, state_size=StateSize(why="one vector per head"),
              cross=Cross(MeanCross, "the mean of the source's values"))
    class PrefixMean(AttentionLayer):
        """Each token reads the mean of the values so far: a memory of one slot."""

        def __init__(self, spec, options):
            super().__init__(spec, bias=options.bias)

        def init_state(self, batch_size, device=None, dtype=None):
            return MeanState()

        def forward(self, x, *, memory_state=None, attention_mask=None, positions=None):
            _, q, k, v = self.project(x, memory_state, attention_mask, positions)
            B, T = x.shape[:2]
            real = torch.ones(B, T, dtype=v.dtype) if attention_mask is None else attention_mask.to(v.dtype)
            real = real[:, :, None, None]
            total, count = (v * real).cumsum(1), real.cumsum(1)  # [B, T, H, D], [B, T, 1, 1]
            if memory_state is not None and memory_state.total is not None:
                total, count = total + memory_state.total[:, None], count + memory_state.count[:, None]
            if not self.spec.causal:
                total, count = total[:, -1:].expand_as(total), count[:, -1:].expand_as(count)
            if memory_state is not None:
                memory_state.total, memory_state.count = total[:, -1], count[:, -1]
                memory_state.seen += T
            return self.finish(total / count.clamp_min(1)), memory_state
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy mechanism, registered by importing its module; unregistered afterwards."""
    before = mechanisms()
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module(MODULE)
        yield get_mechanism(NAME)
    finally:
        if NAME in mechanisms():
            unregister(NAME)
        sys.modules.pop(MODULE, None)
    after = mechanisms()
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)


def generic_tests(path: str):
    """A generic test module loaded afresh, so that its registry-built lists are made now."""
    spec = importlib.util.spec_from_file_location(f"fresh_{Path(path).stem}", TESTS / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_toy_reads_the_mean_of_the_values_so_far(toy):
    """Its layer against the mean written out: y_t = out(Σ_{i≤t} v_i / t)."""
    layer = toy.layer(LayerSpec(8, 2), toy.options()).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    v = x @ layer.qkv.weight[16:].T  # the value rows of the q/k/v projection
    means = torch.stack([v[0, :t + 1].mean(0) for t in range(5)])[None]
    torch.testing.assert_close(layer(x)[0], means @ layer.out.weight.T)


def test_info_lists_the_registered_toy(toy, capsys):
    assert main(["info", "--mechanisms"]) == 0
    out = capsys.readouterr().out
    assert f"{NAME} (causal, encoder, cross; not shown to stream past its training length): " \
           "Each token reads the mean of the values so far: a memory of one slot." in out
    assert "    attention.bias: bool = False" in out.split(f"{NAME} (", 1)[1]


def test_the_generic_model_tests_run_over_the_toy(toy):
    lm, cache, padding = (generic_tests(f"models/{f}") for f in ("test_lm.py", "test_cache.py", "test_padding.py"))
    encoder = generic_tests("models/test_encoder.py")
    assert NAME in lm.CAUSAL and NAME in cache.CAUSAL and NAME in padding.CAUSAL and NAME in encoder.BIDIRECTIONAL
    lm.test_token_by_token_decoding_equals_full_forward(NAME, "rotary")
    cache.test_reordered_rows_decode_as_their_parents(NAME)
    cache.test_the_state_keeps_its_bytes_as_its_registration_declares(NAME)
    padding.test_left_padded_rows_decode_as_each_row_alone(NAME, "learned")
    encoder.test_every_token_sees_the_whole_sequence(NAME)


def test_cross_attention_of_the_toy_comes_from_its_registration(toy):
    assert NAME in cross_mechanisms()
    m = build_cross_attention(NAME, {}, LayerSpec(8, 2)).double()
    src, mask = torch.randn(2, 6, 8, dtype=torch.float64), torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    torch.testing.assert_close(m.memory(src, mask).mean[1], m.memory(src[1:, 2:]).mean[0])
    seq2seq = generic_tests("models/test_seq2seq.py")
    seq2seq.test_every_cross_mechanism_decodes_as_the_full_pass_and_ignores_source_padding(NAME)


def test_the_benchmarks_and_the_recall_experiment_take_the_toy(toy, tmp_path):
    from research.bench import encode
    from research.bench.common import chosen_mechanisms
    from research.bench.settings import BenchSettings, sizes_for
    from research.experiments.recall import NAME as RECALL, QUICK, Settings, plan
    from memattn.typed import parse_settings

    cpu = torch.device("cpu")
    s = BenchSettings(cpu, torch.float32, sizes_for(cpu, quick=True), tmp_path, "memattn bench")
    assert NAME in [c.label for c in chosen_mechanisms(s)]
    assert (NAME, NAME, {}) in encode.variants(s)[0]  # no size option: one row at its options
    recall = parse_settings(Settings, [f"mechanisms=[{NAME}]"], QUICK, name=RECALL)
    (row,), skipped = plan(recall)
    assert not skipped and row["mechanism"] == NAME and row["size_option"] is None
    assert row["sizing"] == "one vector per head"
    H, D = recall.n_heads, recall.d_model // recall.n_heads
    assert row["state_bytes_per_layer"] == (H * D + 1) * 4  # the sum [1, H, D] and count [1, 1, 1], fp32


def test_the_converter_takes_the_toy(toy):
    pytest.importorskip("transformers")
    import transformers

    from memattn.integrations.convert import convert, targets

    assert NAME in targets()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                                      num_hidden_layers=1, intermediate_size=32, vocab_size=20)
    model = convert(transformers.LlamaForCausalLM(config).eval(), NAME)
    assert type(model.model.layers[0].self_attn.layer).__name__ == "PrefixMean"
    ids = torch.randint(0, 20, (1, 7))
    greedy = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **greedy), model.generate(ids, use_cache=False, **greedy))


def test_unregistered_it_is_gone_everywhere(tmp_path, monkeypatch):
    before = mechanisms()
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module(MODULE)
        assert NAME in mechanisms() and NAME in cross_mechanisms()
    finally:
        entry = unregister(NAME)
        sys.modules.pop(MODULE, None)
    assert entry.name == NAME and NAME not in mechanisms() and NAME not in cross_mechanisms()
    assert mechanisms() == before
    assert NAME not in generic_tests("models/test_lm.py").CAUSAL
