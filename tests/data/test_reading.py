"""memattn.data.reading: the seeded synthetic reading task."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from memattn.data.reading import BLANK, ReadingConfig, ReadingTask
from memattn.errors import ConfigError


def facts_in(task, tokens):
    """Parse a document's words into {(entity, relation words): place of the last statement}."""
    words = task.decode(tokens).split()
    relations = [" ".join(task.vocab[i] for i in r) for r in task.relations]
    stated = {}
    sentence = []
    for w in words:
        if w != ".":
            sentence.append(w)
            continue
        if sentence and sentence[0].startswith("entity_") and sentence[-1].startswith("place_"):
            middle = sentence[1:-1]
            if middle[:1] == ["now"]:
                middle = middle[1:]
            if " ".join(middle) in relations:
                stated[(sentence[0], " ".join(middle))] = sentence[-1]  # later ones replace
        sentence = []
    return stated


@pytest.mark.parametrize("p_update", [0.0, 0.5])
def test_every_answer_is_stated_in_its_document(p_update):
    task = ReadingTask(ReadingConfig(doc_len=(150, 400), p_update=p_update, queries_per_doc=5))
    batch = task.batch(40, seed=1)
    updates = 0
    for n in range(len(batch)):
        doc = batch.docs[n, : batch.doc_lengths[n]]
        stated = facts_in(task, doc)
        updates += task.decode(doc).split().count("now")
        for j in range(5):
            query = task.decode(batch.queries[n, j]).split()
            assert query[-1] == BLANK and query[0].startswith("entity_")
            answer = task.vocab[task.places[int(batch.answers[n, j])]]
            assert stated[(query[0], " ".join(query[1:-1]))] == answer
            assert answer not in query  # the query alone does not give it away
        asked = {tuple(batch.queries[n, j].tolist()) for j in range(5)}
        assert len(asked) == 5  # distinct facts
    assert (updates > 0) == (p_update > 0)


def test_lengths_are_in_range_and_padding_is_at_the_end():
    lo, hi = 120, 900
    task = ReadingTask(ReadingConfig(doc_len=(lo, hi)))
    batch = task.batch(60, seed=2)
    lengths = batch.doc_lengths
    assert lo <= int(lengths.min()) and int(lengths.max()) <= hi
    assert int(lengths.max()) - int(lengths.min()) > (hi - lo) // 2  # lengths spread out
    assert batch.docs.shape[1] == int(lengths.max())
    for n in range(len(batch)):
        assert (batch.docs[n, : lengths[n]] != 0).all() and (batch.docs[n, lengths[n]:] == 0).all()
        assert int(batch.query_lengths[n].min()) >= 3


def test_long_documents_of_thousands_of_tokens():
    task = ReadingTask(ReadingConfig(doc_len=(3000, 4000)))
    batch = task.batch(2, seed=0)
    assert 3000 <= int(batch.doc_lengths.min()) and int(batch.doc_lengths.max()) <= 4000
    assert len(facts_in(task, batch.docs[0, : batch.doc_lengths[0]])) >= 3000 // 25 - 1


def test_seeded_determinism():
    task = ReadingTask()
    a, b, c = task.batch(5, seed=7), task.batch(5, seed=7), task.batch(5, seed=8)
    for name in ("docs", "doc_lengths", "queries", "query_lengths", "answers"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.answers, c.answers) or not torch.equal(a.doc_lengths, c.doc_lengths)
    assert ReadingTask().vocab == task.vocab  # the vocabulary depends on the config only


def test_answers_do_not_follow_from_the_query():
    """Places are drawn per document: the same question has many answers across documents."""
    task = ReadingTask(ReadingConfig(n_entities=3, n_relations=1, n_places=10,
                                     doc_len=(40, 60), queries_per_doc=1, fact_every=20))
    batch = task.batch(600, seed=0)
    by_query = {}
    for n in range(len(batch)):
        by_query.setdefault(tuple(batch.queries[n, 0].tolist()), Counter())[int(batch.answers[n, 0])] += 1
    assert len(by_query) == 3
    for counts in by_query.values():
        assert len(counts) == 10  # every place answers every question sometimes
        assert max(counts.values()) < 3 * sum(counts.values()) / 10  # none dominates
    assert task.chance == pytest.approx(0.1)


def test_distractors_mention_entities_and_places_outside_facts():
    task = ReadingTask(ReadingConfig(doc_len=(400, 400)))
    batch = task.batch(3, seed=0)
    words = task.decode(batch.docs[0]).split()
    places = sum(w.startswith("place_") for w in words)
    assert places > len(facts_in(task, batch.docs[0]))


@pytest.mark.parametrize("kwargs, message", [
    ({"doc_len": (500, 100)}, r"reading.doc_len: expected \(shortest, longest\)"),
    ({"doc_len": (10, 100)}, r"reading.doc_len: .*20 <= shortest"),
    ({"n_places": 1}, r"reading.n_places: expected at least 2"),
    ({"n_relations": 7}, r"reading.n_relations: expected 1 to 6"),
    ({"p_update": 1.5}, r"reading.p_update: expected a probability"),
    ({"queries_per_doc": 0}, r"reading.queries_per_doc: expected a positive integer"),
    ({"n_entities": 1, "n_relations": 1, "queries_per_doc": 2}, r"at most n_entities \* n_relations = 1"),
])
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ReadingConfig(**kwargs)


def test_batch_size_must_be_positive():
    with pytest.raises(ConfigError, match="n: expected a positive number of documents"):
        ReadingTask().batch(0, seed=0)
