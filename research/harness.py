"""lm-evaluation-harness as the client of memattn's Hugging Face folders.

Task files over local JSON lines (a rolling perplexity, a multiple-choice task, a
generate_until task), the `lm_eval` command run offline in a process that never imports
memattn (the folder's `auto_map` loads it: the path a user of the harness takes), and the
scores of a trained run on such tasks drawn from the test split of its own corpus.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from memattn.errors import ConfigError

ROLLING, CHOICE, UNTIL = "memattn_rolling", "memattn_choice", "memattn_until"
STOPS = [" ", "\n"]  # a generate_until item asks for one word ...
WORD_TOKENS = 24  # ... of at most this many characters
SCORES = ("bits_per_byte", "choice_acc", "word_exact")  # of `harness_scores`


def write_tasks(root: Path, docs: list[str], choices: list[dict], prompts: list[dict], *,
                until: list[str], max_gen_toks: int) -> Path:
    """The three task files, over JSON lines written beside them, in root/tasks (for
    `--include_path`). docs: texts scored whole (bits per byte); choices: {question, choices,
    answer}, each choice read after the question and a space; prompts: {prompt, target}, a
    greedy continuation of at most max_gen_toks tokens cut at `until` compared with the target."""
    root.mkdir(parents=True, exist_ok=True)
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    for name, rows in (("docs", [{"text": d} for d in docs]), ("choices", choices), ("prompts", prompts)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    def task(name: str, data: str, **fields: Any) -> None:
        lines = [f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
                 f"    test: {json.dumps(str(root / data))}", "test_split: test"]
        lines += [f"{k}: {json.dumps(v)}" for k, v in fields.items()]
        (tasks / f"{name}.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")

    task(ROLLING, "docs.jsonl", output_type="loglikelihood_rolling", doc_to_text="",
         doc_to_target="{{text}}", metric_list=[{"metric": "bits_per_byte"}, {"metric": "word_perplexity"}])
    task(CHOICE, "choices.jsonl", output_type="multiple_choice", doc_to_text="{{question}}",
         doc_to_choice="choices", doc_to_target="answer", metric_list=[{"metric": "acc"}])
    task(UNTIL, "prompts.jsonl", output_type="generate_until", doc_to_text="{{prompt}}",
         doc_to_target="{{target}}", generation_kwargs={"until": until,
                                                       "max_gen_toks": max_gen_toks, "do_sample": False},
         metric_list=[{"metric": "exact_match"}])
    return tasks


def run_lm_eval(folder: Path, root: Path, tasks: Path, *, timeout: float = 3600) -> tuple[dict, dict[str, list]]:
    """The `lm_eval` command on a Hugging Face folder, offline, with the task files in `tasks`,
    its caches and output under root: (results by task, logged samples by task). ConfigError
    when lm-evaluation-harness is not installed or the command fails (its last line)."""
    command = Path(sys.executable).with_name("lm_eval")
    if not command.exists():
        raise ConfigError(f"harness: the lm_eval command is not installed beside {sys.executable} "
                          "(pip install 'lm-eval[hf]')")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(root / "hf-home"),
           "HF_MODULES_CACHE": str(root / "hf-modules"), "TOKENIZERS_PARALLELISM": "false"}
    out = root / "lm-eval-out"
    names = sorted(p.stem for p in tasks.glob("*.yaml"))
    done = subprocess.run([str(command), "--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True",
                           "--tasks", ",".join(names), "--include_path", str(tasks), "--device", "cpu",
                           "--batch_size", "1", "--output_path", str(out), "--log_samples"],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=root)
    if done.returncode != 0:
        raise ConfigError(f"harness: lm_eval failed on {folder}: {done.stderr.strip().splitlines()[-1:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {t: [json.loads(line) for line in next(out.rglob(f"samples_{t}_*.jsonl")).read_text().splitlines()]
               for t in results}
    return results, samples


def split_tasks(text: str, *, documents: int, document_chars: int, items: int, context_chars: int,
                seed: int = 0) -> tuple[list[str], list[dict], list[dict]]:
    """Tasks drawn from a test text: `documents` consecutive pieces of `document_chars` from
    its start; `items` multiple-choice items (the `context_chars` before a word, then that word
    against three other words of the text of the same length) and `items` one-word
    continuations (the same contexts with their space, the word as the target). Word starts
    are drawn with `seed`; a word is a run of lower-case letters after a space and before a
    space or a line's end, as words are what a character model can be asked to finish."""
    if len(text) < documents * document_chars or len(text) < context_chars + 1:
        raise ConfigError(f"harness: the test text has {len(text):,} characters; the tasks need "
                          f"{max(documents * document_chars, context_chars + 1):,}")
    docs = [text[i * document_chars:(i + 1) * document_chars] for i in range(documents)]
    words: dict[int, int] = {}  # start -> length of every word after the first context
    start = None
    for i, ch in enumerate(text + " "):
        if ch.isalpha() and ch.islower() and start is None and i > 0 and text[i - 1] == " ":
            start = i
        elif not (ch.isalpha() and ch.islower()) and start is not None:
            if ch in " \n" and start >= context_chars:
                words[start] = i - start
            start = None
    by_length: dict[int, list[str]] = {}
    for s, n in words.items():
        by_length.setdefault(n, []).append(text[s:s + n])
    rng = random.Random(seed)
    candidates = [s for s, n in words.items() if len(set(by_length[n])) >= 4]
    if len(candidates) < items:
        raise ConfigError(f"harness: the test text has {len(candidates)} words to ask for; the tasks ask for {items}")
    choices, prompts = [], []
    for s in sorted(rng.sample(candidates, items)):
        word = text[s:s + words[s]]
        others = rng.sample(sorted(set(by_length[len(word)]) - {word}), 3)
        answer = rng.randrange(4)
        context = text[s - context_chars:s]
        choices.append({"question": context[:-1], "choices": others[:answer] + [word] + others[answer:],
                        "answer": answer})
        prompts.append({"prompt": context, "target": word})
    return docs, choices, prompts


def harness_scores(run_dir: Path, text: str, seq_len: int, *, documents: int, document_chars: int, items: int,
                   context_chars: int) -> dict[str, Any]:
    """A trained run's scores through lm-evaluation-harness: exported to a Hugging Face folder
    (`memattn export-hf`), scored by the `lm_eval` command on tasks drawn from `text` (its
    corpus's test split, `split_tasks`): bits per byte of the documents (read in lm-eval's
    windows of the run's training length seq_len), multiple-choice accuracy, one-word exact
    match. A context and the word asked for fit in seq_len tokens (lm-eval would cut the context)."""
    if context_chars + WORD_TOKENS > seq_len:
        raise ConfigError(f"harness: contexts of {context_chars} characters and words of up to {WORD_TOKENS} "
                          f"exceed the model's context of {seq_len} tokens")
    from memattn.integrations.export import export_run

    docs, choices, prompts = split_tasks(text, documents=documents, document_chars=document_chars, items=items,
                                         context_chars=context_chars)
    with tempfile.TemporaryDirectory(prefix="memattn-harness-") as scratch:
        root = Path(scratch)
        export_run(run_dir, root / "model")
        tasks = write_tasks(root / "eval", docs, choices, prompts, until=STOPS, max_gen_toks=WORD_TOKENS)
        results, _ = run_lm_eval(root / "model", root / "eval", tasks)
    scores = (results[ROLLING]["bits_per_byte,none"], results[CHOICE]["acc,none"], results[UNTIL]["exact_match,none"])
    return {**dict(zip(SCORES, scores)), "documents": documents,
            "document_chars": document_chars, "items": items, "context_chars": context_chars}
