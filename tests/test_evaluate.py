"""memattn.evaluate: windows with an unscored context, streams with carried state, quality by
length (`evaluate_by_length`), and `memattn eval --context / --stream`, each against a by-hand
computation."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from memattn.config import AttentionConfig, ModelConfig
from memattn.errors import ConfigError
from memattn.evaluate import check_streamable, evaluate, evaluate_by_length, position_buckets
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


# --- quality by length: evaluate_by_length ---

def lm(name, positions="rotary", max_len=128, **options):
    cfg = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, ff_mult=2, max_len=max_len,
                      positions=positions, attention=AttentionConfig(name, options))
    return CausalLM(cfg).double().eval()


def document_losses(model, ids, length, documents):
    """Nats of every target of each document ids[d·L : (d + 1)·L + 1], from one forward pass of
    the model over the whole document: [documents][length]."""
    out = []
    for d in range(documents):
        doc = ids[d * length:(d + 1) * length + 1]
        logits = model(doc[None, :-1])[0]
        out.append(F.cross_entropy(logits, doc[1:], reduction="none").tolist())
    return out


def bpc_by_hand(losses, start, end, chars):
    nats = sum(sum(doc[start:end]) for doc in losses)
    return nats / (len(losses) * (end - start)) / math.log(2) / chars


def test_position_buckets_double_from_the_training_length():
    assert position_buckets(8, 40) == [(0, 8), (8, 16), (16, 32), (32, 40)]
    assert position_buckets(8, 32) == [(0, 8), (8, 16), (16, 32)]
    assert position_buckets(8, 5) == [(0, 5)]


@pytest.mark.parametrize("name,options,read", [("abc-window", {"window": 5}, "stream"),
                                               ("abc-mlp", {"num_slots": 4}, "stream"),
                                               ("softmax", {}, "window")])
def test_by_length_equals_one_pass_over_each_document(name, options, read):
    """Streamed in chunks of 6 (carried cache) or read as one window, every bucket and every
    first-n figure is the by-hand bucketing of one forward pass over each whole document."""
    model = lm(name, **options)
    ids = torch.randint(0, 29, (95,))
    calls = []
    got = evaluate_by_length(model, ids, lengths=[20, 8, 40], train_len=8, streams=2, chunk=6,
                             chars_per_token=1.5, progress=lambda done, total: calls.append((done, total)))
    losses = document_losses(model, ids, 40, 2)
    assert (got["read"], got["documents"], got["length"], got["tokens"]) == (read, 2, 40, 80)
    buckets = [(0, 8), (8, 16), (16, 32), (32, 40)]
    assert [(b["start"], b["end"]) for b in got["buckets"]] == buckets
    for b, (start, end) in zip(got["buckets"], buckets):
        assert b["read"] == read and b["tokens"] == 2 * (end - start)
        assert b["bpc"] == pytest.approx(bpc_by_hand(losses, start, end, 1.5), abs=1e-5)
    assert [n["length"] for n in got["lengths"]] == [8, 20, 40]
    for n in got["lengths"]:
        assert n["read"] == read and n["bpc"] == pytest.approx(bpc_by_hand(losses, 0, n["length"], 1.5), abs=1e-5)
    assert calls[0] == (0, 80) and calls[-1] == (80, 80) and [c[0] for c in calls] == sorted(c[0] for c in calls)
    if read == "stream":  # one state of one size from the first token to the last
        assert got["chunk"] == 6 and len(calls) == 1 + 7
        assert got["state_bytes"] == model.init_cache(2).nbytes() > 0
    else:
        assert got["state_bytes"] is None and got["max_window"] == 16_384


def test_stream_chunks_default_to_the_training_length():
    model = lm("abc-mlp", num_slots=4)
    chunks = []
    model.register_forward_pre_hook(lambda m, args: chunks.append(args[0].shape[1]))
    got = evaluate_by_length(model, torch.randint(0, 29, (50,)), lengths=[20], train_len=8)
    assert got["chunk"] == 8 and chunks == [8, 8, 4]


def test_split_too_short_for_one_document_is_refused():
    with pytest.raises(ConfigError, match=r"--lengths: a document of 40 tokens needs 41 tokens .* holds 30"):
        evaluate_by_length(lm("softmax"), torch.randint(0, 29, (30,)), lengths=[8, 40], train_len=8)
    got = evaluate_by_length(lm("softmax"), torch.randint(0, 29, (60,)), lengths=[40], train_len=8, streams=3)
    assert got["documents"] == 1  # what the split holds


def test_window_past_max_window_is_not_read_and_never_run():
    model = lm("softmax")
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    ids = torch.randint(0, 29, (95,))
    got = evaluate_by_length(model, ids, lengths=[8, 20, 40], train_len=8, streams=2, max_window=20)
    assert max(seen) == 20
    losses = document_losses(model, ids, 40, 2)
    by_length = {n["length"]: n for n in got["lengths"]}
    assert by_length[20]["bpc"] == pytest.approx(bpc_by_hand(losses, 0, 20, 1.0), abs=1e-5)
    assert by_length[40]["bpc"] is None and by_length[40]["read"] is None
    assert by_length[40]["note"] == "not read: a window of 40 tokens exceeds max_window=20"
    assert [b["bpc"] is not None for b in got["buckets"]] == [True, True, False, False]
    assert got["buckets"][2]["note"] == "not read: a window of 32 tokens exceeds max_window=20"


@pytest.mark.parametrize("name,options,read", [("softmax", {}, "window"), ("abc-mlp", {"num_slots": 4}, "stream")])
def test_learned_positions_are_not_read_past_max_len(name, options, read):
    model = lm(name, positions="learned", max_len=24, **options)
    ids = torch.randint(0, 29, (50,))
    got = evaluate_by_length(model, ids, lengths=[16, 40], train_len=8)
    losses = document_losses(model, ids[:25], 24, 1)  # the 24 positions the table covers
    assert got["read"] == read and got["tokens_read"] == 24
    assert [b["bpc"] is not None for b in got["buckets"]] == [True, True, False, False]
    assert got["lengths"][0]["bpc"] == pytest.approx(bpc_by_hand(losses, 0, 16, 1.0), abs=1e-5)
    assert got["lengths"][1]["bpc"] is None
    assert got["lengths"][1]["note"] == "not read: 40 tokens exceed model.max_len=24 of the learned position table"


def test_a_limit_met_while_streaming_ends_the_read_there():
    """abc-linformer has a column per position up to model.max_len: the stream stops at the
    chunk that passes it, and the figures before it stand."""
    model = lm("abc-linformer", max_len=24, num_slots=4)
    got = evaluate_by_length(model, torch.randint(0, 29, (50,)), lengths=[16, 40], train_len=8)
    assert got["tokens_read"] == 24 and got["lengths"][0]["read"] == "stream"
    assert got["lengths"][1]["bpc"] is None and "model.max_len=24" in got["lengths"][1]["note"]


@pytest.mark.parametrize("name,read", [("abc-mlp", "stream"), ("softmax", "window")])
def test_by_length_reads_the_same_positions_in_windows_of_the_training_length(name, read):
    """windows=True: beside each figure, the same positions read as windows of train_len from an
    empty memory (each window one forward pass, by hand here); [0, L) is the same on both sides."""
    model = lm(name, num_slots=4) if name == "abc-mlp" else lm(name)
    ids = torch.randint(0, 29, (95,))
    got = evaluate_by_length(model, ids, lengths=[40], train_len=8, streams=2, chunk=6, windows=True)
    docs = ids[:81].unfold(0, 41, 40)  # [2, 41]
    with torch.no_grad():
        short = torch.cat([F.cross_entropy(model(docs[:, a:a + 8]).transpose(1, 2), docs[:, a + 1:a + 9],
                                           reduction="none") for a in range(0, 40, 8)], 1)  # [2, 40]
    for b in got["buckets"]:
        want = short[:, b["start"]:b["end"]].mean().item() / math.log(2)
        assert b["read"] == read and b["bpc_windows"] == pytest.approx(want, abs=1e-5)
    first = got["buckets"][0]
    assert first["bpc"] == pytest.approx(first["bpc_windows"], abs=1e-5)
    assert "bpc_windows" not in evaluate_by_length(model, ids, lengths=[40], train_len=8)["buckets"][0]
