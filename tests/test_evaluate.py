"""memattn.evaluate: windows with an unscored context, streams with carried state, and
`memattn eval --context / --stream`, each against a by-hand computation."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError
from memattn.evaluate import check_streamable, evaluate
from memattn.models import CausalLM


def small(name, **options):
    cfg = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=128,
                      attention=AttentionConfig(name, options))
    return CausalLM(cfg).double().eval()


def token_losses(model, ids, *, context, seq_len, windows):
    """The loss of every target of every segment, scored token by token through the model's
    cache after the context was read into it: [window][position] nats."""
    out = []
    for i in range(windows):
        start = i * seq_len
        cache = model.init_cache(1)
        if context:
            model(ids[None, start:start + context], cache=cache)
        out.append([F.cross_entropy(model(ids[None, t:t + 1], cache=cache)[0, -1][None],
                                    ids[t + 1:t + 2]).item()
                    for t in range(start + context, start + context + seq_len)])
    return out


def by_hand(model, ids, *, context, seq_len, windows):
    """Sum of target losses of each segment (`token_losses`): (nats, tokens)."""
    losses = token_losses(model, ids, context=context, seq_len=seq_len, windows=windows)
    return sum(map(sum, losses)), sum(map(len, losses))


@pytest.mark.parametrize("name,options", [("softmax", {}), ("abc-mlp", {"num_slots": 4}),
                                          ("abc-window", {"window": 5})])
@pytest.mark.parametrize("context", [0, 7])
def test_context_scores_each_segment_after_reading_its_prefix(name, options, context):
    model = small(name, **options)
    ids = torch.randint(0, 29, (70,))
    seq_len, batch = 9, 2
    got = evaluate(model, ids, seq_len=seq_len, batch_size=batch, context=context)
    windows = (70 - 1 - context) // seq_len
    nats, tokens = by_hand(model, ids, context=context, seq_len=seq_len, windows=windows)
    assert got["tokens"] == tokens == windows * seq_len
    assert got["loss"] == pytest.approx(nats / tokens, rel=1e-6)
    assert got["bpc"] == pytest.approx(nats / tokens / math.log(2), rel=1e-6)


@pytest.mark.parametrize("context", [0, 7])
def test_loss_by_position_in_the_window(context):
    """bpc_by_position[p]: the loss of each window's p-th scored target, token by token through
    the cache, averaged over the windows (an incomplete last batch among them)."""
    model = small("abc-mlp", num_slots=4)
    ids = torch.randint(0, 29, (70,))
    seq_len, chars = 9, 1.5
    got = evaluate(model, ids, seq_len=seq_len, batch_size=4, context=context,
                   chars_per_token=chars, by_position=True)
    windows = (70 - 1 - context) // seq_len
    losses = token_losses(model, ids, context=context, seq_len=seq_len, windows=windows)
    want = [sum(w[p] for w in losses) / windows / math.log(2) / chars for p in range(seq_len)]
    assert got["bpc_by_position"] == pytest.approx(want, rel=1e-6)
    assert sum(got["bpc_by_position"]) / seq_len == pytest.approx(got["bpc"], rel=1e-9)


def test_context_changes_the_score_of_a_memory_model():
    model = small("abc-mlp", num_slots=4)
    ids = torch.randint(0, 29, (200,))
    # the same targets (the split's last 150) scored with and without the 40 tokens before them
    without = evaluate(model, ids[40:], seq_len=30, batch_size=5)
    within = evaluate(model, ids, seq_len=30, batch_size=5, context=40)
    assert without["tokens"] == within["tokens"] == 150
    assert without["loss"] != pytest.approx(within["loss"], rel=1e-6)


def test_stream_carries_the_state_over_the_whole_split():
    model = small("abc-mlp", num_slots=4)
    ids = torch.randint(0, 29, (61,))
    got = evaluate(model, ids, seq_len=10, batch_size=1, segments=True)
    logits = model(ids[None, :60])[0]  # one pass over the whole stream
    want = F.cross_entropy(logits, ids[1:61]).item()
    assert got["tokens"] == 60
    assert got["loss"] == pytest.approx(want, rel=1e-6)


def test_stream_is_refused_for_a_growing_state():
    with pytest.raises(ConfigError, match="grows with the context"):
        check_streamable(small("softmax"))
    check_streamable(small("abc-mlp", num_slots=4))


def test_bad_context_is_a_clear_error():
    model = small("softmax")
    with pytest.raises(ValueError, match="context must be >= 0"):
        evaluate(model, torch.zeros(50, dtype=torch.long), seq_len=8, batch_size=2, context=-1)
    with pytest.raises(ValueError, match="shorter than context"):
        evaluate(model, torch.zeros(50, dtype=torch.long), seq_len=8, batch_size=2, context=45)
    with pytest.raises(ValueError, match="by_position scores the positions of a window"):
        evaluate(model, torch.zeros(50, dtype=torch.long), seq_len=8, batch_size=2,
                 segments=True, by_position=True)


def test_eval_command_context_and_stream(text_file, tmp_path, capsys):
    import json

    from conftest import tiny_overrides

    from memattn.cli import main

    over = tiny_overrides(text_file, tmp_path, "attention=abc-mlp", "attention.num_slots=4",
                          "train.steps=4", "train.eval_every=4", "train.save_every=4", "train.seq_len=16")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    run = str(tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", run, "--context", "16", "--batches", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["context"] == 16 and result["tokens"] == 2 * 16 * 16
    assert main(["eval", run, "--stream", "--batches", "3", "--batch-size", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stream"] and result["tokens"] == 3 * 4 * 16
    assert main(["eval", run, "--stream", "--context", "8"]) == 2
    assert "--context" in capsys.readouterr().err


def test_a_bpe_run_reports_bits_per_character_of_its_text(text_file, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from conftest import tiny_overrides

    from memattn.cli import main
    from memattn.config import load_config
    from memattn.data import Vocab
    from memattn.train import load_run_corpus, model_from_checkpoint, train

    cfg = load_config("tiny", tiny_overrides(text_file, tmp_path, "data.level=bpe", "data.bpe_size=300",
                                             "train.steps=4", "train.eval_batches=0"))
    train(cfg, progress=False)
    _, cfg, vocab = model_from_checkpoint(tmp_path / "run")
    val = load_run_corpus(cfg).val
    chars = len(Vocab.from_json(vocab).decode(val))  # the text itself, counted apart from the corpus
    assert chars > 1.5 * len(val)  # merges: fewer tokens than characters
    record = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()][-1]
    assert record["val_bpc"] == pytest.approx(record["val_loss"] / math.log(2) * len(val) / chars, rel=1e-9)
    assert main(["eval", str(tmp_path / "run"), "--split", "val", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bpc"] == pytest.approx(result["bits_per_token"] * len(val) / chars, rel=1e-9)
