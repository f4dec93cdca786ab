"""lm-evaluation-harness as the client: its `lm_eval` command, offline, with task files written
here over local data, scores an exported memattn model and a converted model as memattn's own
loader computes them: a rolling perplexity, a multiple-choice task and a generate_until task."""

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from memattn.cli import main  # noqa: E402
from memattn.errors import ConfigError  # noqa: E402
from research.harness import STOPS, WORD_TOKENS, harness_scores, run_lm_eval, split_tasks, write_tasks  # noqa: E402

from conftest import logprobs, rolling, tiny_overrides  # noqa: E402

pytestmark = pytest.mark.slow

DOCS = ["Good night sweet prince and to be or not to be what light doth speak thou art my lord.",
        "The queen doth speak to the king. My lord, good night! Sweet prince, what light is this?"]
CHOICES = [{"question": "Good night sweet", "choices": ["prince", "queen", "lord"], "answer": 0},
           {"question": "To be or not to", "choices": ["be", "king"], "answer": 0}]
PROMPTS = [{"prompt": "The king", "target": " doth"}, {"prompt": "Good night", "target": " sweet"}]


def lm_eval(folder: Path, root: Path) -> tuple[dict, dict[str, list]]:
    """The `lm_eval` command on the folder over this file's three tasks (research.harness)."""
    return run_lm_eval(folder, root, write_tasks(root, DOCS, CHOICES, PROMPTS, until=["\n", "."], max_gen_toks=6))


def check_scores(results, samples, logits_of, encode, bos: int, L: int, greedy) -> None:
    """lm-eval's three scores are those of `logits_of` (memattn's loader), computed here."""
    ll = sum(rolling(logits_of, encode(d), bos, L) for d in DOCS)
    n_bytes = sum(len(d.encode("utf-8")) for d in DOCS)
    assert abs(results["memattn_rolling"]["bits_per_byte,none"] - (-ll / n_bytes / math.log(2))) < 1e-6
    for sample, doc in zip(sorted(samples["memattn_choice"], key=lambda s: s["doc_id"]), CHOICES):
        got = [float(r[0][0]) for r in sample["resps"]]
        context = encode(doc["question"])  # lm-eval's split: the whole encoded, less the context
        want = [logprobs(logits_of, context, encode(f"{doc['question']} {c}")[len(context):]) for c in doc["choices"]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    for sample, doc in zip(sorted(samples["memattn_until"], key=lambda s: s["doc_id"]), PROMPTS):
        assert sample["resps"][0][0] == greedy(doc["prompt"], 6)


def test_lm_eval_scores_an_exported_model_as_memattn_does(text_file, tmp_path):
    from memattn.train import model_from_checkpoint

    over = tiny_overrides(text_file, tmp_path, "train.steps=30", "train.seq_len=32", "attention=abc-mlp",
                          "attention.num_slots=4")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    folder = tmp_path / "exported"
    assert main(["export-hf", str(tmp_path / "run"), "-o", str(folder)]) == 0
    net, cfg, vocab = model_from_checkpoint(tmp_path / "run")
    from memattn.data import Vocab

    chars = Vocab.from_json(vocab)
    separator = int(chars.encode("\n")[0])  # what the exported bos reads as

    def greedy(prompt, steps):  # cut where lm-eval cuts: at its stop strings
        seq = chars.encode(prompt).tolist()
        for _ in range(steps):
            seq.append(int(net(torch.tensor([seq]))[0, -1].argmax()))
        text = chars.decode(seq[len(chars.encode(prompt)):])
        return min((text.split(stop)[0] for stop in ("\n", ".")), key=len)

    results, samples = lm_eval(folder, tmp_path)
    with torch.no_grad():
        check_scores(results, samples, lambda ids: net(ids), lambda t: chars.encode(t).tolist(), separator,
                     cfg.train.seq_len, greedy)


def test_lm_eval_scores_a_converted_model_as_memattn_does(text_file, tmp_path):
    from test_convert_train import pretrained

    from memattn.integrations.convert import load_converted

    tok = pretrained(tmp_path / "llama", text_file)
    folder = tmp_path / "converted"
    assert main(["convert", str(tmp_path / "llama"), "--attention", "abc-mlp", "attention.num_slots=4",
                 "--layers", "1", "-o", str(folder)]) == 0
    model = load_converted(folder)

    def greedy(prompt, steps):
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        return min((text.split(stop)[0] for stop in ("\n", ".")), key=len)

    results, samples = lm_eval(folder, tmp_path)
    with torch.no_grad():
        check_scores(results, samples, lambda ids: model(ids).logits, lambda t: tok(t).input_ids,
                     tok.bos_token_id, model.config.max_position_embeddings, greedy)


def test_split_tasks_ask_for_the_words_that_follow_in_the_text():
    text = "a b " + " ".join(["the cat sat on a mat", "then the dog ran far", "she sat and ran on"] * 4) + "\n"
    docs, choices, prompts = split_tasks(text, documents=2, document_chars=10, items=6, context_chars=12, seed=3)
    assert docs == [text[:10], text[10:20]]
    assert split_tasks(text, documents=2, document_chars=10, items=6, context_chars=12, seed=3)[1] == choices
    for choice, prompt in zip(choices, prompts):
        word = prompt["target"]
        at = len(prompt["prompt"])  # the prompt is the 12 characters before the word, its space included
        assert any(text[i - at:i] == prompt["prompt"] and text[i:i + len(word) + 1] in (word + " ", word + "\n")
                   for i in range(at, len(text)))
        assert prompt["prompt"].endswith(" ") and len(prompt["prompt"]) == 12 and word.isalpha() and word.islower()
        assert choice["question"] == prompt["prompt"][:-1] and choice["choices"][choice["answer"]] == word
        assert len(set(choice["choices"])) == 4 and {len(c) for c in choice["choices"]} == {len(word)}
        assert all(f" {c} " in text or f" {c}\n" in text for c in choice["choices"])
    with pytest.raises(ConfigError, match="the test text has 9 characters; the tasks need 20"):
        split_tasks(text[:9], documents=2, document_chars=10, items=1, context_chars=4)
    with pytest.raises(ConfigError, match="words to ask for; the tasks ask for 500"):
        split_tasks(text, documents=1, document_chars=10, items=500, context_chars=4)


def test_harness_scores_are_those_of_memattn_s_own_loader_on_the_drawn_tasks(tmp_path):
    import random

    from memattn.data import Vocab
    from memattn.train import load_run_corpus, model_from_checkpoint

    rng = random.Random(0)  # lines whose words a small model learns to finish, so that some match
    sentences = ["the cat sat on the mat", "a dog ran to the park", "my lord doth speak softly",
                 "good night sweet prince"]
    text_file = tmp_path / "lines.txt"
    text_file.write_text("".join(rng.choice(sentences) + "\n" for _ in range(800)))
    over = tiny_overrides(text_file, tmp_path, "train.steps=300", "train.seq_len=32", "attention=gsa",
                          "attention.num_slots=4")
    assert main(["train", "--config", "tiny", "--quiet", *over]) == 0
    net, cfg, vocab = model_from_checkpoint(tmp_path / "run")
    corpus = load_run_corpus(cfg)
    text = corpus.vocab.decode(corpus.test)
    sizes = {"documents": 2, "document_chars": 80, "items": 12, "context_chars": 8}  # 8 + WORD_TOKENS ≤ L
    got = harness_scores(tmp_path / "run", text, cfg.train.seq_len, **sizes)
    with pytest.raises(ConfigError, match="exceed the model's context of 32 tokens"):
        harness_scores(tmp_path / "run", text, cfg.train.seq_len, **{**sizes, "context_chars": 9})
    docs, choices, prompts = split_tasks(text, **sizes)
    chars = Vocab.from_json(vocab)
    encode = lambda t: chars.encode(t).tolist()  # noqa: E731
    with torch.no_grad():
        logits_of = lambda ids: net(ids)  # noqa: E731
        ll = sum(rolling(logits_of, encode(d), int(chars.encode("\n")[0]), cfg.train.seq_len) for d in docs)
        right = [max(range(4), key=lambda j: logprobs(logits_of, encode(c["question"]),
                                                       encode(f"{c['question']} {c['choices'][j]}")[len(c["question"]):]))
                 == c["answer"] for c in choices]
        exact = []
        for p in prompts:
            seq = encode(p["prompt"])
            for _ in range(WORD_TOKENS):
                seq.append(int(net(torch.tensor([seq[-cfg.train.seq_len:]]))[0, -1].argmax()))
            said = chars.decode(seq[len(encode(p["prompt"])):])
            exact.append(min((said.split(stop)[0] for stop in STOPS), key=len) == p["target"])
    assert got["bits_per_byte"] == pytest.approx(-ll / sum(len(d.encode()) for d in docs) / math.log(2), abs=1e-6)
    assert got["choice_acc"] == pytest.approx(sum(right) / len(right))
    assert got["word_exact"] == pytest.approx(sum(exact) / len(exact))
    assert {k: got[k] for k in sizes} == sizes and got["word_exact"] > 0.5
