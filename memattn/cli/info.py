"""`memattn info`: a model's parameters, shape and decoding-state memory, and the mechanisms."""

from __future__ import annotations

import json
from pathlib import Path

from memattn.cli.common import check_fits_in_memory, non_decoding_run, run_config, with_config
from memattn.errors import ConfigError


def mechanism_table() -> str:
    """Every registered mechanism: where it works, its summary, and each option with its type
    and default, as `attention.OPTION=VALUE` sets it."""
    import dataclasses
    import typing

    from memattn.layers import mechanisms

    lines = []
    for name, mech in mechanisms().items():
        uses = [use for use, ok in (("causal", mech.causal), ("encoder", mech.bidirectional),
                                    ("cross", mech.cross is not None)) if ok]
        if not mech.causal:
            streams = ""
        elif mech.streams(mech.options()):
            streams = "; streams past its training length"
        elif callable(mech.streaming):
            streams = "; streams past its training length with the options that say so"
        else:
            streams = "; not shown to stream past its training length"
        lines.append(f"{name} ({', '.join(uses)}{streams}): {mech.summary}")
        if mech.causal:
            state = "fixed" if mech.fixed_size(mech.options()) else "grows"
            if callable(mech.fixed_state):
                state += " at its defaults (options decide)"
            if mech.state_size is not None:
                size = mech.state_size
                state += f"; sized by attention.{size.option}" if size.option else f"; {size.why}"
            lines.append(f"    decoding state: {state}")
        if mech.cross is not None:
            lines.append(f"    cross attention memory: {mech.cross.memory}")
        lines.append("    memattn convert: " + ("yes" if mech.convertible else "no (memattn's own models only)"))
        hints = typing.get_type_hints(mech.options)
        for f in dataclasses.fields(mech.options):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            hint = hints[f.name]
            if typing.get_origin(hint) is typing.Literal:
                kind = " | ".join(map(str, typing.get_args(hint)))
            else:
                kind = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
            lines.append(f"    attention.{f.name}: {kind} = {default!r}")
    return "\n".join(lines)


def state_memory(model, lengths=(64, 128)) -> tuple[int, float]:
    """(fixed bytes, bytes per token) of the decoding state, measured on a batch of one."""
    import torch

    sizes = []
    for n in lengths:
        cache = model.init_cache(1)
        with torch.no_grad():
            model(torch.zeros(1, n, dtype=torch.long), cache=cache)
        sizes.append(cache.nbytes())
    per_token = (sizes[1] - sizes[0]) / (lengths[1] - lengths[0])
    return int(sizes[0] - per_token * lengths[0]), per_token


def cmd_info(args) -> int:
    import dataclasses

    from memattn.analysis import learned_spans
    from memattn.layers import mechanisms
    from memattn.models import CausalLM
    from memattn.tasks import TASKS, task_class

    words = [o for o in args.overrides if "=" not in o]
    if len(words) == 1 and not args.checkpoint and Path(words[0]).exists():  # memattn info RUN
        args.checkpoint = words[0]
        args.overrides.remove(words[0])
    if args.checkpoint:
        from memattn.train import model_from_checkpoint

        if args.overrides:
            raise ConfigError(f"info: {' '.join(args.overrides)}: a checkpoint is described as it was "
                              "saved; key=value overrides describe a model built from --config")
        model, cfg, _ = model_from_checkpoint(args.checkpoint)
    else:
        cfg = run_config(args)
        model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or 256)
        check_fits_in_memory(lambda: CausalLM(model_cfg), "info")
        model = CausalLM(model_cfg).eval()
    causal = non_decoding_run(model, cfg) is None  # a memattn causal LM decodes
    converted = task_class(cfg.task).generates and not causal  # a converted model keeps no memattn cache
    fixed, per_token = (state_memory(model, (min(64, cfg.model.max_len // 2), min(128, cfg.model.max_len)))
                        if causal else (None, None))
    m = cfg.model
    info = {
        "task": cfg.task, "attention": m.attention.name, "options": m.attention.options,
        "parameters": model.num_parameters(), "layers": m.n_layers, "d_model": m.d_model,
        "heads": m.n_heads, "positions": m.positions, "vocab_size": model.cfg.vocab_size if hasattr(model, "cfg") else m.vocab_size,
        "state_fixed_bytes": fixed, "state_bytes_per_token": per_token,
    }
    if causal:  # each layer's own state: a hybrid mixes fixed and growing ones
        from memattn.analysis import state_bytes_by_layer

        info["state_by_layer"] = state_bytes_by_layer(model, (min(64, m.max_len // 2), min(128, m.max_len)))
    spans = learned_spans(model)
    if spans:  # adaptive attention span: z per head (tokens), per layer
        info["spans"] = {str(i): [round(z, 1) for z in zs] for i, zs in enumerate(spans) if zs}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"attention      {info['attention']} {info['options'] or ''}")
    print(f"parameters     {info['parameters']:,}")
    if not converted:  # a converted model's shape is its own config's
        print(f"shape          {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, "
              f"{m.positions} positions, vocabulary {info['vocab_size']}")
    if causal:
        print(f"decoding state {fixed:,} bytes fixed + {per_token:,.0f} bytes per token of context"
              f" (batch 1, fp32{'; constant in context length' if per_token == 0 else ''})")
        for layer in info["state_by_layer"]:
            print(f"  layer {layer['layer']:<8}{layer['attention']}: {layer['fixed_bytes']:,} bytes fixed"
                  + (f" + {layer['bytes_per_token']:,.0f} per token" if layer["bytes_per_token"] else ""))
    else:
        print(f"task           {cfg.task} ("
              + ("a converted transformers model" if converted else TASKS[cfg.task].summary) + ")")
    for n, (i, zs) in enumerate(info.get("spans", {}).items()):
        print(f"{'learned spans' if n == 0 else '':<15}layer {i}: {', '.join(f'{z:g}' for z in zs)} tokens")
    if args.mechanisms:
        print(mechanism_table())
    elif not args.checkpoint:
        print("mechanisms     " + ", ".join(mechanisms()) + " (--mechanisms: their options)")
    return 0


def add_commands(sub) -> None:
    i = sub.add_parser("info", help="parameters and decoding-state memory of a model",
                       description="Describe a checkpoint, or a model built from a config: "
                       "parameters, shape and the memory its decoding state holds per token.")
    i.add_argument("--checkpoint", help="checkpoint file or run folder (default: build from --config); "
                   "`memattn info RUN` also names one")
    with_config(i)
    i.add_argument("--mechanisms", action="store_true", help="also list the registered mechanisms")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(fn=cmd_info)
