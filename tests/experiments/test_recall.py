"""memattn.data.recall (MQAR and passkey generators, answer scoring) and
research.experiments.recall (sizing, settings, a quick run end to end)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from memattn.config import AttentionConfig
from memattn.data.recall import RecallVocab, answer_hits, answer_loss, mqar_batch, passkey_batch
from memattn.errors import ConfigError
from research.experiments import get_experiment
from research.experiments.recall import (
    NAME,
    QUICK,
    Settings,
    build_model,
    plan,
    state_bytes,
)
from memattn.layers.base import _REGISTRY, mechanisms
from memattn.typed import parse_settings

VOCAB = RecallVocab(keys=8, values=8, filler=4)  # PASS 0, QUERY 1, digits 2-11, filler 12-15, keys 16-23, values 24-31


def test_vocabulary_blocks():
    assert (VOCAB.first_digit, VOCAB.first_filler, VOCAB.first_key, VOCAB.first_value, VOCAB.size) == \
        (2, 12, 16, 24, 32)


def test_mqar_rows_written_out():
    tokens, answers = mqar_batch(2, length=12, pairs=3, vocab=VOCAB, generator=torch.Generator().manual_seed(0))
    # row 0: pairs (18, 24) (19, 28) (20, 26), then queries 18 -> 24, 20 -> 26, 19 -> 28
    assert tokens.tolist() == [[18, 24, 19, 28, 20, 26, 18, 24, 20, 26, 19, 28],
                               [20, 25, 21, 30, 22, 31, 22, 31, 20, 25, 21, 30]]
    assert answers.tolist() == [[False] * 7 + [True, False, True, False, True]] * 2


def test_mqar_keys_are_distinct_and_each_query_gets_its_pairs_value():
    pairs, length = 5, 30  # 10 queries: every key asked twice
    tokens, answers = mqar_batch(16, length=length, pairs=pairs, vocab=VOCAB,
                                 generator=torch.Generator().manual_seed(3))
    for row, mask in zip(tokens.tolist(), answers.tolist()):
        keys, values = row[0:2 * pairs:2], row[1:2 * pairs:2]
        assert len(set(keys)) == pairs and all(VOCAB.first_key <= k < VOCAB.first_value for k in keys)
        assert all(VOCAB.first_value <= v < VOCAB.size for v in values)
        paired = dict(zip(keys, values))
        asked = row[2 * pairs::2]
        assert sorted(asked) == sorted(keys * 2)  # a random order of the keys, then another
        assert row[2 * pairs + 1::2] == [paired[k] for k in asked]
        assert [t for t, m in enumerate(mask) if m] == list(range(2 * pairs + 1, length, 2))


def test_passkey_rows_written_out():
    g = torch.Generator().manual_seed(0)
    tokens, answers = passkey_batch(1, distance=3, digits=2, vocab=VOCAB, generator=g, length=12)
    row = tokens[0].tolist()
    # PASS d d | 3 filler | QUERY d d | filler to length 12
    assert row[0] == VOCAB.PASS and row[6] == VOCAB.QUERY and row[7:9] == row[1:3]
    assert all(2 <= d < 12 for d in row[1:3]) and all(12 <= f < 16 for f in row[3:6] + row[9:])
    assert answers[0].tolist() == [False] * 7 + [True, True] + [False] * 3


def test_passkey_sits_at_the_stated_distance():
    distance = torch.tensor([0, 5, 17])
    tokens, answers = passkey_batch(3, distance=distance, digits=4, vocab=VOCAB,
                                    generator=torch.Generator().manual_seed(1))
    assert tokens.shape == (3, 2 + 2 * 4 + 17)
    for row, mask, d in zip(tokens.tolist(), answers.tolist(), distance.tolist()):
        query = row.index(VOCAB.QUERY)
        assert query - (1 + 4) == d  # the filler between the passkey's last digit and the query
        assert row[query + 1:query + 5] == row[1:5]
        assert [t for t, m in enumerate(mask) if m] == list(range(query + 1, query + 5))
    tokens, _ = passkey_batch(2, distance=1000, digits=5, vocab=VOCAB, generator=torch.Generator().manual_seed(1))
    assert tokens.shape == (2, 1012) and (tokens[:, 1006] == VOCAB.QUERY).all()


def test_generators_name_the_bad_argument():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ConfigError, match="pairs: expected 1 .. 8"):
        mqar_batch(1, length=40, pairs=9, vocab=VOCAB, generator=g)
    with pytest.raises(ConfigError, match="length: expected 2·pairs plus an even number"):
        mqar_batch(1, length=11, pairs=3, vocab=VOCAB, generator=g)
    with pytest.raises(ConfigError, match="length: a passkey of 2 digits at distance 10 needs 16 tokens"):
        passkey_batch(1, distance=10, digits=2, vocab=VOCAB, generator=g, length=12)


def test_scoring_counts_exactly_the_answer_positions():
    tokens, answers = mqar_batch(3, length=20, pairs=4, vocab=VOCAB, generator=torch.Generator().manual_seed(2))
    V = VOCAB.size
    # logits at t put all mass on token t + 1: every prediction right
    right = torch.full((3, 20, V), -1e4)
    right[:, :-1].scatter_(2, tokens[:, 1:, None], 0.0)
    assert torch.equal(answer_hits(right, tokens, answers), answers)
    assert answer_loss(right, tokens, answers).item() == pytest.approx(0.0, abs=1e-6)
    # wrong everywhere but before the answers: the same hits
    wrong = right.roll(1, dims=2)
    before_answer = torch.zeros_like(answers)
    before_answer[:, :-1] = answers[:, 1:]
    mixed = torch.where(before_answer[..., None], right, wrong)
    assert torch.equal(answer_hits(mixed, tokens, answers), answers)
    # one answer predicted wrong: exactly one hit fewer; all wrong before the answers: none
    b, t = answers.nonzero()[4].tolist()
    mixed[b, t - 1] = wrong[b, t - 1]
    hits = answer_hits(mixed, tokens, answers)
    assert hits.sum() == answers.sum() - 1 and not hits[b, t] and not (hits & ~answers).any()
    assert not answer_hits(torch.where(before_answer[..., None], wrong, right), tokens, answers).any()
    # uniform logits: the loss is ln V whatever the answers
    assert answer_loss(torch.zeros(3, 20, V), tokens, answers).item() == pytest.approx(math.log(V))


def test_settings_are_typed_and_checked():
    s = parse_settings(Settings, ["steps=12", "state_bytes=[4096,16384]", "mechanisms=[softmax,linear]"], name=NAME)
    assert (s.steps, s.state_bytes, s.mechanisms) == (12, (4096, 16384), ("softmax", "linear"))
    assert s.train_distance == 64 - 2 - 2 * 5
    assert s.kinds == [("softmax", {}), ("linear", {})]
    # the default: every causal mechanism, and the options that make abc-mlp stream
    kinds = parse_settings(Settings, [], name=NAME).kinds
    assert kinds == [(n, {}) for n, m in mechanisms().items() if m.causal] + [
        ("abc-mlp", {"recency": True}), ("abc-mlp", {"forget": True})]
    s = parse_settings(Settings, ["mechanisms=[gsa,abc-mlp:recency=true;forget=true,gsa]"], name=NAME)
    assert s.kinds == [("gsa", {}), ("abc-mlp", {"recency": True, "forget": True})]
    for entry, match in [("abc-workspace", "'abc-workspace' is not all or a causal mechanism"),  # encoder only
                         ("abc-mlp:num_slots=4", "sets what the targets .state_bytes. set: attention.num_slots"),
                         ("abc-mlp:recency=3", "recency"), ("abc-mlp:nope=1", "nope")]:
        with pytest.raises(ConfigError, match=match):
            parse_settings(Settings, [f"mechanisms=[{entry}]"], name=NAME)
    with pytest.raises(ConfigError, match="length: a row is 8 pairs"):
        parse_settings(Settings, ["length=33"], name=NAME)
    with pytest.raises(ConfigError, match="mqar_share: expected a share strictly between 0 and 1, got 1.0"):
        parse_settings(Settings, ["mqar_share=1"], name=NAME)
    with pytest.raises(ConfigError, match="steps: expected positive values"):
        parse_settings(Settings, ["steps=0"], name=NAME)


def test_sizing_picks_the_option_closest_to_each_target_and_lets_new_mechanisms_join(monkeypatch):
    s = parse_settings(Settings, ["mechanisms=[abc-mlp,linear,softmax]", "state_bytes=[2048,8192]"],
                       QUICK, name=NAME)
    planned, skipped = plan(s)
    mlp = [p for p in planned if p["mechanism"] == "abc-mlp"]
    assert [p["options"]["num_slots"] for p in mlp] == [8, 32] and [p["targets"] for p in mlp] == [[2048], [8192]]
    for p in planned:
        model = build_model(s, AttentionConfig(p["mechanism"], p["options"]))
        assert state_bytes(model, s.length)[0] / s.n_layers == p["state_bytes_per_layer"]
    (linear,) = [p for p in planned if p["mechanism"] == "linear"]
    assert linear["size_option"] is None and linear["targets"] == [2048, 8192] and not skipped
    (softmax,) = [p for p in planned if p["mechanism"] == "softmax"]  # grows, and no option sizes it
    assert softmax["size_option"] is None and "the ceiling" in softmax["sizing"]
    # a mechanism whose registration declares no size option: one row at its default options
    monkeypatch.setitem(_REGISTRY, "abc-mlp", dataclasses.replace(_REGISTRY["abc-mlp"], state_size=None))
    planned, skipped = plan(s)
    (mlp,) = [p for p in planned if p["mechanism"] == "abc-mlp"]
    assert mlp["options"] == {} and "no option sizes its state" in mlp["sizing"] and not skipped


@pytest.mark.slow
def test_quick_run_writes_the_table_plot_and_command_and_reuses_finished_models(tmp_path):
    (tmp_path / "command.txt").write_text("memattn experiment recall --quick\n")
    result = get_experiment("recall").run(tmp_path, quick=True, overrides=[], jobs=1)
    table = (tmp_path / "results.md").read_text()
    assert (tmp_path / "recall.png").stat().st_size > 0
    assert result["command"] == "memattn experiment recall --quick" and result["command"] in table
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == result["rows"]
    assert "Seeds:" in table and "Budget:" in table and "## The literature found / we measured" in table
    causal = {name for name, m in mechanisms().items() if m.causal}
    listed = [r["mechanism"] for r in result["rows"]] + [k["mechanism"] for k in result["skipped"]]
    assert set(listed) == causal and all(k["reason"] for k in result["skipped"])
    assert all(f"| {name} |" in table for name in causal)
    # abc-mlp's forgetting rules are rows of their own, marked as streaming
    own = {r["kind"]: r for r in result["rows"] if r["mechanism"] == "abc-mlp"}
    assert set(own) == {"abc-mlp", "abc-mlp recency=True", "abc-mlp forget=True"}
    assert own["abc-mlp recency=True"]["options"]["recency"] is True and own["abc-mlp recency=True"]["streams"]
    assert not own["abc-mlp"]["streams"] and own["abc-mlp forget=True"]["model"].endswith(" forget=True")
    s = parse_settings(Settings, [], QUICK, name=NAME)
    for row in result["rows"]:
        model = build_model(s, AttentionConfig(row["mechanism"], row["options"]))
        assert row["state_bytes"] == state_bytes(model, s.length)[0], row["model"]
        assert 0.0 <= row["mqar_accuracy"] <= 1.0
        assert [p["distance"] for p in row["passkey"]] == [s.train_distance, *s.distances]
        for p in row["passkey"]:
            assert (p["accuracy"] is None) == p["note"].startswith("not read"), (row["model"], p)
    (ceiling,) = [r for r in result["rows"] if r["mechanism"] == "softmax"]
    assert not ceiling["fixed_size"] and ceiling["passkey"][-1]["read"] == "window"
    assert all(r["fixed_size"] for r in result["rows"] if r is not ceiling)
    # a second run reuses every finished model
    rows = {p: p.stat().st_mtime_ns for p in tmp_path.glob("runs/*/row.json")}
    again = get_experiment("recall").run(tmp_path, quick=True, overrides=[], jobs=1)
    assert again["rows"] == result["rows"] and {p: p.stat().st_mtime_ns for p in rows} == rows


def test_an_interrupted_model_resumes_from_its_checkpoint_to_the_same_row(tmp_path, monkeypatch):
    """A model trains through memattn train's loop as task=recall: cut after its checkpoint at
    step 2 and run again, it resumes there and ends with the uninterrupted run's log and row."""
    import research.experiments.recall as recall
    from research.experiments._runner import train_and_measure

    s = parse_settings(Settings, ["mechanisms=[abc-window]"], QUICK, name=NAME)
    (planned,), _ = plan(s)
    job = recall.job_of(s, planned)
    whole = train_and_measure(tmp_path / "whole", job, recall.measure)
    batch = recall.training_batch

    def interrupted(o, rows, seed, step):
        if step == 3:
            raise KeyboardInterrupt
        return batch(o, rows, seed, step)

    monkeypatch.setattr(recall, "training_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_and_measure(tmp_path / "cut", job, recall.measure)
    assert not (tmp_path / "cut" / "row.json").exists()
    monkeypatch.setattr(recall, "training_batch", batch)
    resumed = train_and_measure(tmp_path / "cut", job, recall.measure)
    logs = [(tmp_path / d / "log.jsonl").read_text().splitlines() for d in ("whole", "cut")]
    assert [json.loads(line)["loss"] for line in logs[0]] == [json.loads(line)["loss"] for line in logs[1]]
    for key in ("mqar_accuracy", "passkey", "state_bytes", "steps"):
        assert resumed[key] == whole[key], key


def test_the_task_trains_what_the_experiment_planned(tmp_path):
    """A job's settings are memattn train's (task=recall with the settings' options): its model
    is build_model's, its batches the experiment's rows, its loss the mean of the two tasks'."""
    import research.experiments.recall as recall
    from memattn.config import load_config
    from memattn.tasks import task_class
    from memattn.train import Distributed, build_model as train_model

    s = parse_settings(Settings, ["mechanisms=[linear]"], QUICK, name=NAME)
    (planned,), _ = plan(s)
    cfg = load_config(None, [*recall.job_of(s, planned).settings, f"train.out_dir={tmp_path}"])
    assert cfg.task_settings == s.options and cfg.train.betas == (0.9, 0.98)
    task = task_class(NAME).prepare(cfg, Distributed("cpu"), False, None)
    torch.manual_seed(0)
    model = train_model(task.cfg)
    torch.manual_seed(0)
    assert str(model) == str(build_model(s, AttentionConfig("linear", planned["options"])))
    batch = task.batch(5, 0, 1)
    m = round(s.batch * s.mqar_share)
    (mqar, mqar_answers), (passkey, passkey_answers) = batch
    assert mqar.shape == (m, s.length) and passkey.shape == (s.batch - m, s.length)
    want = (answer_loss(model(mqar), mqar, mqar_answers) + answer_loss(model(passkey), passkey, passkey_answers)) / 2
    total, scored, _ = task.loss(model, batch)
    assert scored == 1 and torch.allclose(total, want) and task.tokens(batch) == s.batch * s.length
    # two ranks share the rows: the first holds MQAR rows only, the second the rest
    halves = [task.batch(5, r, 2) for r in (0, 1)]
    for part in range(2):
        for i in range(2):
            assert torch.equal(torch.cat([h[part][i] for h in halves]), batch[part][i])
    assert [len(h.mqar[0]) for h in halves] == [min(m, s.batch // 2), max(0, m - s.batch // 2)]


def test_passkeys_train_in_rows_of_their_own_length():
    """passkey_length: the passkey rows (and the distances trained) run to it, MQAR keeps its
    rows, the models' positions reach the longer rows; a job names the option only when set, so
    the run folders made before it existed are reused."""
    import research.experiments.recall as recall

    s = parse_settings(Settings, ["mechanisms=[abc-mlp]", "passkey_length=80"], QUICK, name=NAME)
    assert s.train_distance == 80 - 2 - 2 * s.digits and s.longest == 80
    (mqar, _), (passkey, answers) = recall.training_batch(s.options, 400, 0, 3)
    assert mqar.shape[1] == s.length and passkey.shape[1] == 80
    query = (passkey == RecallVocab.QUERY).float().argmax(1)  # the query marker: 1 + digits + distance
    distances = query - 1 - s.digits
    assert int(distances.min()) == 0 and int(distances.max()) == s.train_distance
    assert torch.equal(answers.sum(1), torch.full((len(passkey),), s.digits))
    planned, _ = plan(s)
    job = recall.job_of(s, planned[0])
    assert "task_options.passkey_length=80" in job.settings and "model.max_len=80" in job.settings
    assert build_model(s, AttentionConfig("abc-mlp", planned[0]["options"])).cfg.max_len == 80
    plain = recall.job_of(parse_settings(Settings, [], name=NAME), {**planned[0], "options": {"num_slots": 8}})
    assert not any("passkey_length" in x for x in plain.settings)
    with pytest.raises(ConfigError, match="passkey_length: a passkey of 5 digits needs rows of at least 12 tokens"):
        parse_settings(Settings, ["passkey_length=11"], name=NAME)
