"""`memattn export-hf`: a trained run as a Hugging Face folder that says what it is.

A memattn causal LM or masked-LM encoder exports as model_type "memattn"
(`memattn.integrations.hf`), with its vocabulary as a tokenizer (`tokenizer_of`) and the
vocabulary itself (HF_VOCAB, what `train.init_from` reads); a run that trained a converted
transformers model (`memattn convert`, then `train.init_from`) exports as its converted
family, with the tokenizer the run read its text with. Either way the folder carries the
context length trained at (config and tokenizer), bos/eos (a causal LM's document separator
where its vocabulary has one), auto_map and `modeling_memattn.py`, and a model card with the
run's data, steps and last scores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memattn.errors import ConfigError
from memattn.integrations.folders import write_card


def run_facts(cfg: Any, meta: dict) -> dict[str, Any]:
    """What a run's checkpoint says for a model card: data, steps, context length, scores."""
    data = cfg.data
    where = f" ({data.path})" if getattr(data, "path", None) else ""
    level = getattr(data, "level", None)
    tokenizer = getattr(data, "tokenizer", None)
    read = f"read with the tokenizer {tokenizer}" if tokenizer else f"{level} level" if level else ""
    metrics = meta.get("metrics") or {}
    scores = {k.replace("_", " "): v for k, v in metrics.items() if isinstance(v, (int, float))}
    if scores:
        scores = {f"{k} (the run's last evaluation, {cfg.train.seq_len}-token windows)" if k.startswith("val")
                  else k: v for k, v in scores.items()}
    return {"data": f"{data.corpus}{where}{', ' + read if read else ''}", "steps": meta.get("step"),
            "context_length": cfg.train.seq_len, "scores": scores}


def export_run(run: str | Path, out: Path) -> str:
    """Write the run `run` (folder or checkpoint) as a transformers folder `out`; returns the
    Auto class that loads it."""
    from memattn.checkpoint import load_checkpoint
    from memattn.data.vocab import Vocab
    from memattn.integrations.convert import ConvertedLM
    from memattn.integrations.hf import (MemattnForCausalLM, MemattnForMaskedLM, card_facts, separator_of,
                                         tokenizer_of)
    from memattn.models import CausalLM, Encoder
    from memattn.train import model_from_checkpoint, run_weights
    from memattn.warmstart import HF_VOCAB

    model, cfg, vocab = model_from_checkpoint(run)
    facts = run_facts(cfg, load_checkpoint(run_weights(run) if Path(run).is_dir() else run).meta)
    if isinstance(model, ConvertedLM):
        return _export_converted(model.hf, cfg, facts, out)
    if type(model) not in (CausalLM, Encoder):
        raise ConfigError(f"export-hf: {run} is a {cfg.task} run; causal LMs (task=lm) and masked-LM "
                          "encoders (task=mlm) are exported")
    causal = isinstance(model, CausalLM)
    words = Vocab.from_json(vocab)
    tokenizer = tokenizer_of(words, masked=not causal)
    tokenizer.model_max_length = cfg.train.seq_len
    special: dict[str, Any] = {"pad_token_id": tokenizer.pad_token_id, "max_position_embeddings": cfg.train.seq_len}
    if causal and tokenizer.bos_token_id is not None:
        special.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       separator_token_id=separator_of(words))
    wrapper = MemattnForCausalLM if causal else MemattnForMaskedLM
    hf = wrapper.from_memattn(model, **special)
    hf.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / HF_VOCAB).write_text(json.dumps(vocab))
    separator = tokenizer.convert_ids_to_tokens(special.get("separator_token_id")) \
        if special.get("separator_token_id") is not None else None
    note = (f"Its tokenizer has the ids of memattn's vocabulary ({HF_VOCAB}); bos/eos is {tokenizer.bos_token!r}, "
            f"an id past the vocabulary that the model reads as {separator!r}, the text that joined documents "
            "in training, so no text decodes to it." if separator is not None
            else f"Its tokenizer has the ids of memattn's vocabulary ({HF_VOCAB}).")
    write_card(out, {**card_facts(hf), **{k: v for k, v in facts.items() if v}, "tokenizer_note": note,
                     "separator": separator is not None})
    return "AutoModelForCausalLM" if causal else "AutoModelForMaskedLM"


def _export_converted(model: Any, cfg: Any, facts: dict[str, Any], out: Path) -> str:
    """A trained converted model: its converted family's folder, with the run's tokenizer."""
    from memattn.integrations.convert import converted_card_facts, source_tokenizer

    tokenizer = source_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    if tokenizer is None:
        raise ConfigError(f"export-hf: the run read its text with data.tokenizer={cfg.data.tokenizer!r}, "
                          "which cannot be loaded now; export needs the tokenizer beside the model")
    seq_len = cfg.train.seq_len
    if getattr(model.config, "max_position_embeddings", None) is not None and not hasattr(model.config, "n_positions"):
        model.config.max_position_embeddings = seq_len  # rotary positions: no table sized by it
    tokenizer.model_max_length = seq_len
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    card = converted_card_facts(model)
    card["what"] += " Then trained by memattn (`memattn train train.init_from=...`)."
    write_card(out, {**card, **{k: v for k, v in facts.items() if v}})
    return type(model)._memattn_auto
