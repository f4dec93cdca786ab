"""memattn.models.qa.ReadingQA: each attention variant's read against its closed form."""

from __future__ import annotations

import pytest
import torch

from memattn.data.reading import ReadingConfig, ReadingTask
from memattn.errors import ConfigError, ShapeError
from memattn.models.qa import ATTENTIONS, QAConfig, ReadingQA
from memattn.representations import load, lookup, save

F64 = torch.float64


@pytest.fixture(scope="module")
def data():
    task = ReadingTask(ReadingConfig(doc_len=(40, 90), queries_per_doc=3))
    return task, task.batch(4, seed=0)


def model(task, attention, hidden=6):
    torch.manual_seed(0)
    return ReadingQA(QAConfig(task.vocab_size, task.n_answers, attention=attention, embed=8,
                              hidden=hidden)).double().eval()


def states(m, batch):
    h, mask, final = m.encode_documents(batch.docs, batch.doc_lengths)
    return h, mask, final, m.encode_queries(batch.queries, batch.query_lengths)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_shapes(data, attention):
    task, batch = data
    m = model(task, attention)
    logits = m(batch.docs, batch.doc_lengths, batch.queries, batch.query_lengths)
    assert logits.shape == (4, 3, task.n_answers)
    h, mask, final, q = states(m, batch)
    assert h.shape == (4, batch.docs.shape[1], 12) and final.shape == (4, 12) and q.shape == (4, 3, 12)
    assert mask.sum(1).tolist() == batch.doc_lengths.tolist()
    assert (h[~mask] == 0).all()  # nothing past a document's end


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_reads_match_their_closed_forms(data, attention):
    task, batch = data
    m = model(task, attention)
    h, mask, final, q = states(m, batch)
    r = m.read(h, mask, final, q)
    for n in range(4):
        hn = h[n, : batch.doc_lengths[n]]  # [t, k] real states only
        for j in range(3):
            if attention == "none":
                want = final[n]
            elif attention == "softmax":
                want = torch.softmax(hn @ q[n, j], 0) @ hn
            else:
                f = hn if attention == "linear" else torch.sigmoid(hn @ m.gate.weight.T + m.gate.bias) * hn
                want = sum(torch.outer(s, s) for s in f) @ q[n, j]  # C q, C = Σ f fᵀ
            torch.testing.assert_close(r[n, j], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attention", ["linear", "gated-linear"])
def test_linear_read_equals_c_q_from_the_representation_api(data, attention, tmp_path):
    task, batch = data
    m = model(task, attention)
    h, mask, final, q = states(m, batch)
    reps = m.represent(batch.docs, batch.doc_lengths)
    assert reps.memory.shape == (4, 1, 12, 12) and reps.meta["attention"] == attention
    torch.testing.assert_close(lookup(reps, q), m.read(h, mask, final, q), rtol=1e-10, atol=1e-10)
    save(tmp_path / "docs.safetensors", reps)
    stored = load(tmp_path / "docs.safetensors", key_dim=12, dtype=F64)
    logits = m(batch.docs, batch.doc_lengths, batch.queries, batch.query_lengths)
    torch.testing.assert_close(m.answer(stored, batch.queries, batch.query_lengths), logits,
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_padding_after_a_document_changes_nothing(data, attention):
    task, batch = data
    m = model(task, attention)
    padded = torch.cat([batch.docs, torch.zeros(4, 7, dtype=torch.long)], 1)
    a = m(batch.docs, batch.doc_lengths, batch.queries, batch.query_lengths)
    b = m(padded, batch.doc_lengths, batch.queries, batch.query_lengths)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    one = m(batch.docs[1:2, : batch.doc_lengths[1]], batch.doc_lengths[1:2], batch.queries[1:2],
            batch.query_lengths[1:2])
    torch.testing.assert_close(one[0], a[1], rtol=1e-10, atol=1e-10)  # as if alone


@pytest.mark.parametrize("attention", ["softmax", "linear", "gated-linear"])
def test_the_answer_depends_on_the_document(data, attention):
    task, batch = data
    m = model(task, attention)
    other = batch.docs.clone()
    other[0, 5] = (other[0, 5] % (task.vocab_size - 1)) + 1
    a = m(batch.docs, batch.doc_lengths, batch.queries, batch.query_lengths)
    b = m(other, batch.doc_lengths, batch.queries, batch.query_lengths)
    assert not torch.allclose(a[0], b[0]) and torch.equal(a[1:], b[1:])


def test_gradients_reach_every_parameter(data):
    task, batch = data
    m = ReadingQA(QAConfig(task.vocab_size, task.n_answers, attention="gated-linear", embed=8,
                           hidden=6))
    logits = m(batch.docs, batch.doc_lengths, batch.queries, batch.query_lengths)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.answers.flatten()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_bad_config_and_input(data):
    task, batch = data
    with pytest.raises(ConfigError, match="attention: expected one of none, softmax, linear, gated-linear"):
        QAConfig(10, 5, attention="abc")
    with pytest.raises(ConfigError, match="hidden: expected a positive integer"):
        QAConfig(10, 5, hidden=0)
    m = model(task, "softmax")
    with pytest.raises(ConfigError, match="represent: fixed-size representations need attention linear"):
        m.represent(batch.docs, batch.doc_lengths)
    with pytest.raises(ShapeError, match=r"lengths: expected values in 1"):
        m(batch.docs, torch.zeros(4, dtype=torch.long), batch.queries, batch.query_lengths)
    with pytest.raises(ShapeError, match=r"queries: expected 3 dims \[N, Q, Lq\]"):
        m(batch.docs, batch.doc_lengths, batch.queries[:, 0], batch.query_lengths)
