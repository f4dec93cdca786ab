"""`memattn export-hf` and `memattn convert`: Hugging Face transformers folders written from a run,
or from a pretrained model whose attention is replaced by a mechanism."""

from __future__ import annotations

import sys

from memattn.cli.common import new_output_folder
from memattn.errors import ConfigError


def cmd_export_hf(args) -> int:
    try:
        from memattn.integrations.export import export_run
    except ImportError as e:
        raise ConfigError(str(e)) from None

    with new_output_folder(args.out, {"the run": args.run}) as work:
        auto = export_run(args.run, work)
    print(f"memattn export-hf: wrote {args.out} (config.json, model.safetensors, the tokenizer, a model card); "
          f"load it with AutoTokenizer and {auto}.from_pretrained after `import memattn.integrations.hf` "
          "(or with trust_remote_code=True)", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from memattn.typed import parse_key_value

    try:
        from memattn.integrations.convert import convert_pretrained
    except ImportError as e:
        raise ConfigError(str(e)) from None
    options = {}
    for text in args.overrides:
        path, value = parse_key_value(text)
        if len(path) != 2 or path[0] != "attention":
            raise ConfigError(f"{text}: expected attention.OPTION=VALUE (an option of {args.attention!r})")
        options[path[1]] = value
    layers = None
    if args.layers:
        try:
            layers = [int(i) for i in args.layers.split(",")]
        except ValueError:
            raise ConfigError(f"--layers: expected layer numbers like 0,2,5, got {args.layers!r}") from None
    with new_output_folder(args.out, {"the model": args.model}) as work:
        had_tokenizer = convert_pretrained(args.model, args.attention, options, layers, work)
    kept = ("with its tokenizer" if had_tokenizer
            else "without a tokenizer (the source has none; give data.tokenizer= to train it)")
    print(f"memattn convert: wrote {args.out} {kept}; load it with transformers' Auto classes after "
          "`import memattn.integrations.hf` (or with trust_remote_code=True), or train on with "
          f"`memattn train train.init_from={args.out}`", file=sys.stderr)
    return 0


def add_commands(sub) -> None:
    h = sub.add_parser("export-hf", help="write a run as a Hugging Face transformers folder",
                       description="Write a trained causal LM or masked-LM encoder (or a trained "
                       "converted model) as a transformers model folder (config.json, model.safetensors, "
                       "the run's vocabulary as a tokenizer, a model card), with its own model type, the "
                       "context length trained at and a bos/eos token: loadable with AutoTokenizer and "
                       "AutoModelForCausalLM / AutoModelForMaskedLM.from_pretrained once "
                       "`memattn.integrations.hf` is imported or with trust_remote_code=True "
                       "(pipelines, PEFT, lm-evaluation-harness), and usable as train.init_from. "
                       "Needs memattn[hf].")
    h.add_argument("run", help="run folder or checkpoint written by `memattn train`")
    h.add_argument("-o", "--out", required=True, help="folder to write (new or empty)")
    h.set_defaults(fn=cmd_export_hf)

    cv = sub.add_parser("convert", help="replace a pretrained transformers model's attention by a mechanism",
                        description="Load a Hugging Face model folder (Llama, Mistral, Qwen2/3, GPT-2, "
                        "BERT, RoBERTa), replace its self-attention by a memattn mechanism (q/k/v/o "
                        "weights copied, everything else untouched, the mechanism's own parameters "
                        "new) and save it with its own model type (memattn-llama, ...), loadable with "
                        "transformers' Auto classes once `memattn.integrations.hf` is imported or with "
                        "trust_remote_code=True. A folder memattn wrote already is refused (convert the "
                        "original). Needs memattn[hf].")
    cv.add_argument("model", help="a transformers model folder (or hub name, where a network is there)")
    cv.add_argument("--attention", required=True,
                    help="the mechanism (memattn info --mechanisms: those with 'memattn convert: yes')")
    cv.add_argument("overrides", nargs="*", metavar="attention.OPTION=VALUE",
                    help="options of the mechanism, e.g. attention.num_slots=32")
    cv.add_argument("--layers", default="", help="comma-separated layer numbers to convert (default: all)")
    cv.add_argument("-o", "--out", required=True, help="folder to write (new or empty)")
    cv.set_defaults(fn=cmd_convert)
