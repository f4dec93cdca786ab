"""What a Hugging Face folder written by memattn carries besides its weights, and the checks
that read it back. No transformers here: telling and checking a folder needs none.

Every folder memattn writes (`memattn export-hf`: model_type "memattn"; `memattn convert`:
"memattn-llama", "memattn-gpt2", ... one per source family) holds:

- config.json with its own `model_type`, so that no tool loads it as something else, and
  `memattn_format` (FORMAT): a folder of a later format is refused with the file named;
- `auto_map` and REMOTE_MODULE + ".py", a copy of `memattn/integrations/modeling_memattn.py`:
  `trust_remote_code=True` loads the folder with memattn installed but not imported (the
  module imports memattn's classes; without memattn it says what to install);
- README.md, a model card: what the model is, how much state it keeps, how it was trained
  and scored where that is known, and how to load it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from memattn.errors import ConfigError

FORMAT = 1  # the layout of the folders this memattn writes; it reads FORMAT and earlier
FORMAT_KEY = "memattn_format"
REMOTE_MODULE = "modeling_memattn"  # the module `auto_map` names, copied into each folder
INSTALL = "pip install 'memattn[hf]'"


def config_file(config: Any) -> str:
    """The config.json a transformers config was read from, for error messages ("the model
    config" when it was built in memory)."""
    where = getattr(config, "_name_or_path", "") or ""
    return f"{where}/config.json" if where else "the model config"


def check_format(value: Any, where: str) -> None:
    """ConfigError unless `value` (a config's memattn_format; None: written before formats were
    recorded) is a format this memattn reads."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {FORMAT_KEY} is {value!r}, expected a format number (1 .. {FORMAT}); "
                          "the file was edited by hand or not written by memattn")
    if value > FORMAT:
        raise ConfigError(f"{where}: written in memattn folder format {value}, this memattn reads formats up "
                          f"to {FORMAT}; upgrade memattn ({INSTALL} --upgrade)")


def read_config(folder: str | Path) -> dict:
    """A folder's config.json as a mapping (ConfigError naming the file when it is not JSON)."""
    path = Path(folder) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; not a Hugging Face model folder") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write_remote_code(folder: str | Path, auto_map: dict[str, str]) -> None:
    """Copy REMOTE_MODULE into `folder` and set config.json's auto_map ({Auto class: class
    name}) to name its classes, with FORMAT recorded."""
    folder = Path(folder)
    shutil.copyfile(Path(__file__).with_name(REMOTE_MODULE + ".py"), folder / f"{REMOTE_MODULE}.py")
    path = folder / "config.json"
    config = read_config(folder)
    config["auto_map"] = {auto: f"{REMOTE_MODULE}.{name}" for auto, name in auto_map.items()}
    config[FORMAT_KEY] = FORMAT
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n}"


def state_line(fixed: float, per_token: float) -> str:
    """The decoding state in words: fixed bytes and bytes per token of context (batch of one)."""
    if per_token <= 0:
        return f"fixed in size: {_bytes(fixed)} per sequence, whatever the context length"
    return f"{_bytes(fixed)} fixed + {_bytes(per_token)} per token of context (it grows with the context)"


def write_card(folder: str | Path, facts: dict[str, Any]) -> None:
    """README.md of a folder: a model card from `facts`, each optional:

    title, what (one paragraph), mechanism, options, layers, source, state (fixed, per_token),
    context_length, data, steps, scores ({name: value}), load (the Auto class name),
    separator (whether bos/eos is the document separator), tokenizer_note."""
    folder = Path(folder)
    auto = facts.get("load", "AutoModelForCausalLM")
    lines = ["---", "library_name: transformers", "tags:", "- memattn"]
    if facts.get("mechanism"):
        lines.append(f"- {facts['mechanism']}")
    lines += ["---", "", f"# {facts.get('title') or folder.name}", ""]
    if facts.get("what"):
        lines += [facts["what"], ""]
    rows = [("attention mechanism", facts.get("mechanism")),
            ("its options", json.dumps(facts["options"], sort_keys=True) if facts.get("options") else
             ("defaults" if facts.get("mechanism") else None)),
            ("layers converted", facts.get("layers")),
            ("converted from", facts.get("source")),
            ("decoding state", state_line(*facts["state"]) if facts.get("state") else None),
            ("context length trained at" if facts.get("steps") is not None else "context length",
             f"{facts['context_length']:,} tokens" if facts.get("context_length") else None),
            ("training data", facts.get("data")),
            ("training steps", f"{facts['steps']:,}" if facts.get("steps") is not None else None)]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v is not None] + [""]
    if facts.get("scores"):
        lines += ["## Scores", "", "| measure | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
                  for k, v in facts["scores"].items()] + [""]
    else:
        lines += ["## Scores", "", "Not measured when the folder was written.", ""]
    lines += ["## How to load", "",
              "With memattn installed (`" + INSTALL + "`), either import it or let transformers run "
              f"the folder's `{REMOTE_MODULE}.py`:", "", "```python",
              f"from transformers import AutoTokenizer, {auto}",
              "import memattn.integrations.hf  # registers memattn's model types (or: trust_remote_code=True)",
              "", f'model = {auto}.from_pretrained("{folder.name}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{folder.name}")', "```", ""]
    if auto == "AutoModelForCausalLM":
        lines += ["lm-evaluation-harness reads it as it is: `lm_eval --model hf --model_args "
                  f"pretrained={folder.name},trust_remote_code=True --tasks ...`, in windows of its context "
                  "length (`max_position_embeddings`" + (", the tokenizer's `model_max_length`"
                                                         if facts.get("steps") is not None else "") + ")"
                  + (", starting a text from its bos token, the document separator" if facts.get("separator")
                     else "") + ".", ""]
    if facts.get("tokenizer_note"):
        lines += [facts["tokenizer_note"], ""]
    lines += ["Written by memattn (attention over a memory).", ""]
    (folder / "README.md").write_text("\n".join(lines))
