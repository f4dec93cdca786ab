"""lm-evaluation-harness as the client: its `lm_eval` command, offline, with task files written
here over local data, scores an exported memattn model and a converted model as memattn's own
loader computes them: a rolling perplexity, a multiple-choice task and a generate_until task."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from memattn.cli import main  # noqa: E402

from conftest import tiny_overrides  # noqa: E402

pytestmark = pytest.mark.slow

DOCS = ["Good night sweet prince and to be or not to be what light doth speak thou art my lord.",
        "The queen doth speak to the king. My lord, good night! Sweet prince, what light is this?"]
CHOICES = [{"question": "Good night sweet", "choices": ["prince", "queen", "lord"], "answer": 0},
           {"question": "To be or not to", "choices": ["be", "king"], "answer": 0}]
PROMPTS = [{"prompt": "The king", "target": " doth"}, {"prompt": "Good night", "target": " sweet"}]


def write_tasks(root: Path) -> Path:
    """Three task files over local JSON lines (`dataset_path: json`), in a folder for --include_path."""
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows in (("docs", [{"text": d} for d in DOCS]), ("choices", CHOICES), ("prompts", PROMPTS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def task(name, data, **fields):
        lines = [f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
                 f"    test: {root / data}", "test_split: test"]
        lines += [f"{k}: {json.dumps(v)}" for k, v in fields.items()]
        (tasks / f"{name}.yaml").write_text("\n".join(lines) + "\n")

    task("memattn_rolling", "docs.jsonl", output_type="loglikelihood_rolling", doc_to_text="",
         doc_to_target="{{text}}", metric_list=[{"metric": "bits_per_byte"}, {"metric": "word_perplexity"}])
    task("memattn_choice", "choices.jsonl", output_type="multiple_choice", doc_to_text="{{question}}",
         doc_to_choice="choices", doc_to_target="answer", metric_list=[{"metric": "acc"}])
    task("memattn_until", "prompts.jsonl", output_type="generate_until", doc_to_text="{{prompt}}",
         doc_to_target="{{target}}", generation_kwargs={"until": ["\n", "."], "max_gen_toks": 6, "do_sample": False},
         metric_list=[{"metric": "exact_match"}])
    return tasks


def lm_eval(folder: Path, root: Path) -> tuple[dict, dict[str, list]]:
    """Run the `lm_eval` command in a process that never imports memattn (trust_remote_code
    loads the folder), offline; (results by task, logged samples by task)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(root / "hf-home"),
           "HF_MODULES_CACHE": str(root / "hf-modules"), "TOKENIZERS_PARALLELISM": "false"}
    out = root / "lm-eval-out"
    command = [str(Path(sys.executable).with_name("lm_eval")), "--model", "hf", "--model_args",
               f"pretrained={folder},trust_remote_code=True", "--tasks",
               "memattn_rolling,memattn_choice,memattn_until", "--include_path", str(write_tasks(root)),
               "--device", "cpu", "--batch_size", "1", "--output_path", str(out), "--log_samples"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {t: [json.loads(line) for line in next(out.rglob(f"samples_{t}_*.jsonl")).read_text().splitlines()]
               for t in results}
    return results, samples


def logprobs(logits_of, context: list[int], targets: list[int]) -> float:
    """Σ log p(target | context, earlier targets): the last len(targets) positions of one pass."""
    ids = context + targets[:-1]
    logp = torch.log_softmax(logits_of(torch.tensor([ids])).float(), -1)[0, -len(targets):]
    return float(logp.gather(-1, torch.tensor(targets)[:, None]).double().sum())


def rolling(logits_of, ids: list[int], bos: int, L: int) -> float:
    """Σ log p of every token of a text, read in windows of at most L tokens: the first from bos,
    each later chunk of L predicted from the L tokens before its last (lm-eval's windows)."""
    total, start = 0.0, 0
    while start < len(ids):
        end = min(start + L, len(ids))
        context = [bos] + ids[:start] if start == 0 else ids[end - L - 1:start]
        total += logprobs(logits_of, context, ids[start:end])
        start = end
    return total


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
