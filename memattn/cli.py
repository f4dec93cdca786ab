"""The `memattn` command line: train, eval, generate, info, demo, experiment, compress, decompress, bench.

Every command that builds a run takes `--config PRESET_OR_YAML` and `key=value` overrides,
e.g. `memattn train --config demo model.n_layers=2 attention=softmax train.steps=100`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memattn.errors import MemattnError

OVERRIDES_HELP = ("key=value overrides of the config, checked against its fields: "
                  "model.* data.* train.*, and attention=NAME / attention.OPTION=VALUE "
                  "for the mechanism (e.g. model.d_model=128 train.steps=200 attention=softmax)")


def _run_config(args):
    from memattn.config import load_config

    return load_config(args.config, args.overrides)


def cmd_train(args) -> int:
    from memattn.train import train

    cfg = _run_config(args)
    summary = train(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet)
    if summary.get("complete"):
        print(f"{cfg.train.out_dir}: the run is complete at step {summary['checkpoint_step']} "
              f"(train.steps={cfg.train.steps}); nothing to train. Give a larger train.steps to go on.")
    elif summary.get("val"):
        val = summary["val"]
        score = (f"val bpc {val['bpc']:.3f}" if "bpc" in val else
                 f"val masked accuracy {100 * val['accuracy']:.1f} %" if "accuracy" in val else
                 f"val perplexity {val['ppl']:.2f}")
        print(f"{summary['attention']}: {summary['params']:,} parameters, {summary['steps']} steps, "
              f"{score}, {summary['tokens_per_s']:,.0f} tokens/s, checkpoint {summary['checkpoint']}")
    return 0


def cmd_eval(args) -> int:
    from memattn.errors import ConfigError
    from memattn.evaluate import as_tensor, check_streamable, evaluate
    from memattn.train import checkpoint_split, model_from_checkpoint

    for name, value, least in (("--seq-len", args.seq_len, 0), ("--batch-size", args.batch_size, 1),
                               ("--batches", args.batches, 0)):
        if value < least:
            raise ConfigError(f"{name}: expected a number >= {least}, got {value}")
    lengths = parse_lengths(args.lengths) if args.lengths is not None else None
    by_length = ("--streams", args.streams), ("--max-window", args.max_window), ("--chunk", args.chunk), \
        ("--plot", args.plot)
    if lengths is None and any(value is not None for _, value in by_length):
        given = [name for name, value in by_length if value is not None]
        raise ConfigError(f"{' / '.join(given)}: options of --lengths; give --lengths too")
    if lengths is not None and (args.context or args.stream or args.seq_len):
        raise ConfigError("--lengths: reads whole documents from their first token (streamed or as one "
                          "window); not with --context, --stream or --seq-len")
    check_device(args.device)
    model, cfg, vocab = model_from_checkpoint(args.checkpoint, args.device)
    if lengths is not None and (cfg.task != "lm" or not hasattr(model, "init_cache")):
        raise ConfigError(f"--lengths: measures memattn's causal language models; {args.checkpoint} is a "
                          f"{cfg.task} run{' of a converted model' if cfg.task == 'lm' else ''}")
    if cfg.task == "translation":
        return eval_translation(args, model, cfg, vocab)
    ids, chars_per_token, note = checkpoint_split(args.checkpoint, cfg, vocab, args.split)
    if note:
        print(f"memattn eval: note: {note}", file=sys.stderr)
    if lengths is not None:
        return eval_by_length(args, model, cfg, as_tensor(ids), lengths, chars_per_token)
    if cfg.task == "mlm":
        return eval_masked(args, model, cfg, ids)
    ids = as_tensor(ids)
    seq_len = args.seq_len or cfg.train.seq_len
    stream = args.stream or cfg.train.segments
    if args.context < 0:
        raise ConfigError(f"--context: expected a number of tokens >= 0, got {args.context}")
    if stream and args.context:
        raise ConfigError("--context: a stream (--stream, or a run trained with train.segments) "
                          "already reads everything before each segment")
    if args.stream:
        check_streamable(model)
    result = evaluate(model, ids, seq_len=seq_len, batch_size=args.batch_size,
                      max_batches=args.batches, device=args.device, segments=stream,
                      context=args.context, chars_per_token=chars_per_token)
    result.update(split=args.split, seq_len=seq_len, context=args.context, stream=stream,
                  checkpoint=str(args.checkpoint))
    reading = ("one stream per row, state carried" if stream else
               f"segments of {seq_len} after {args.context} unscored tokens")
    print(json.dumps(result) if args.json else
          f"{args.split}: loss {result['loss']:.4f} nats, {result['bpc']:.4f} bits/char, "
          f"perplexity {result['ppl']:.3f} over {result['tokens']:,} tokens ({reading})")
    return 0


def parse_lengths(text: str) -> list[int]:
    """`--lengths 512,2048,8192`: positive numbers of tokens, else ConfigError."""
    from memattn.errors import ConfigError

    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"--lengths: expected positive numbers of tokens separated by commas "
                          f"(e.g. 512,2048,8192), got {text!r}")
    return sorted(set(lengths))


def eval_by_length(args, model, cfg, ids, lengths, chars_per_token) -> int:
    """`memattn eval --lengths`: bits per character by position bucket and over the first n tokens
    (`memattn.evaluate.evaluate_by_length`), as a table or JSON, and optionally a plot."""
    from memattn.errors import ConfigError
    from memattn.evaluate import MAX_WINDOW, evaluate_by_length, plot_by_length

    streams, chunk, max_window = args.streams or 1, args.chunk or 0, args.max_window or MAX_WINDOW
    for name, value, least in (("--streams", streams, 1), ("--chunk", chunk, 0), ("--max-window", max_window, 1)):
        if value < least:
            raise ConfigError(f"{name}: expected a number >= {least}, got {value}")
    bar = None

    def progress(done: int, total: int) -> None:  # tokens scored, on stderr
        nonlocal bar
        if bar is None:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc=f"eval {cfg.model.attention.name} by length", unit="token",
                       unit_scale=True, dynamic_ncols=True)
        bar.update(done - bar.n)

    try:
        result = evaluate_by_length(model, ids, lengths=lengths, train_len=cfg.train.seq_len, streams=streams,
                                    device=args.device, chars_per_token=chars_per_token, chunk=chunk,
                                    max_window=max_window, progress=None if args.json or args.quiet else progress)
    finally:
        if bar is not None:
            bar.close()
    result.update(split=args.split, attention=cfg.model.attention.name, checkpoint=str(args.checkpoint))
    if result["documents"] < streams:
        print(f"memattn eval: note: the {args.split} split holds {result['documents']} document(s) of "
              f"{result['length']:,} tokens, not --streams {streams}", file=sys.stderr)
    if args.plot:
        plot_by_length(result, args.plot, title=f"{result['attention']}: {args.split} bpc by position")
    if args.json:
        print(json.dumps(result))
        return 0
    how = (f"streamed in chunks of {result['chunk']:,} tokens, state {result['state_bytes']:,} bytes at the end"
           if result["read"] == "stream" else f"each read as one window of at most {result['max_window']:,} tokens")
    print(f"{args.split}: {result['attention']} trained on {result['train_len']:,} tokens, "
          f"{result['documents']} document(s) of {result['length']:,} tokens, {how}")

    def row(label: str, r: dict) -> str:
        bpc = f"{r['bpc']:.4f}" if r["bpc"] is not None else "-"
        return f"{label:<22}{bpc:>8}  {r['read'] or r['note']}"

    print(f"{'positions':<22}{'bpc':>8}  read")
    for b in result["buckets"]:
        print(row(f"[{b['start']:,}, {b['end']:,})", b))
    print(f"{'first n tokens':<22}{'bpc':>8}  read")
    for n in result["lengths"]:
        print(row(f"{n['length']:,}", n))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def eval_translation(args, model, cfg, vocab_json) -> int:
    """`memattn eval` of a translation run: loss and perplexity of the split's references,
    then its sources translated (--beam) and scored with SacreBLEU and chrF."""
    from memattn.data import Vocab
    from memattn.translation import evaluate_pairs, load_parallel_corpus, score_translations, translate_texts

    if args.stream or args.context or args.seq_len:
        raise MemattnError("--stream / --context / --seq-len: for language models, not a translation run")
    vocab = Vocab.from_json(vocab_json)
    split = load_parallel_corpus(cfg, vocab).split(args.split)
    n = min(len(split), args.batches * args.batch_size) if args.batches else len(split)
    result = evaluate_pairs(model, split, vocab, batch_size=args.batch_size, max_batches=args.batches,
                            device=args.device)
    start = time.perf_counter()
    hyps = translate_texts(model, vocab, split.source_text[:n], beam=args.beam,
                           length_penalty=args.length_penalty, batch_size=args.batch_size,
                           device=args.device, where=f"the {args.split} split")
    seconds = time.perf_counter() - start
    result.update(score_translations(hyps, split.target_text[:n]), split=args.split, sentences=n,
                  beam=args.beam, length_penalty=args.length_penalty, translate_s=round(seconds, 2),
                  checkpoint=str(args.checkpoint))
    print(json.dumps(result) if args.json else
          f"{args.split}: loss {result['loss']:.4f} nats, perplexity {result['ppl']:.3f} over "
          f"{result['tokens']:,} target tokens; BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f} "
          f"over {n:,} sentences (beam {args.beam}, {seconds:.1f} s)")
    return 0


def eval_masked(args, model, cfg, ids) -> int:
    """`memattn eval` of a masked-LM run: loss, perplexity and accuracy at the masked positions
    of the split's windows (masks drawn from the run's seed)."""
    from memattn.evaluate import as_tensor
    from memattn.masked import evaluate_masked, windows

    if args.stream or args.context:
        raise MemattnError("--stream / --context: for causal language models, not a masked-LM run")
    seq_len = args.seq_len or cfg.train.seq_len
    data = windows(as_tensor(ids), seq_len, args.batches * args.batch_size if args.batches else 1 << 62)
    result = evaluate_masked(model, data, cfg.model.vocab_size - 1, args.batch_size, cfg.train.seed, args.device)
    result.update(split=args.split, seq_len=seq_len, checkpoint=str(args.checkpoint))
    print(json.dumps(result) if args.json else
          f"{args.split}: loss {result['loss']:.4f} nats, perplexity {result['ppl']:.3f}, accuracy "
          f"{100 * result['accuracy']:.2f} % over {result['tokens']:,} masked tokens (windows of {seq_len})")
    return 0


def cmd_translate(args) -> int:
    from memattn.data import Vocab
    from memattn.errors import ConfigError
    from memattn.train import model_from_checkpoint
    from memattn.translation import translate_texts

    if args.beam < 1:
        raise ConfigError(f"--beam: expected a beam of at least 1, got {args.beam}")
    check_device(args.device)
    model, cfg, vocab_json = model_from_checkpoint(args.run, args.device)
    if cfg.task != "translation":
        raise ConfigError(f"{args.run}: a {cfg.task} run; `memattn translate` needs a translation run")
    path = Path(args.input)
    if not path.is_file():
        raise ConfigError(f"--input: no such file {path}")
    texts = path.read_text(encoding="utf-8").splitlines()
    out = translate_texts(model, Vocab.from_json(vocab_json), texts, beam=args.beam,
                          length_penalty=args.length_penalty, max_len=args.max_len or None,
                          batch_size=args.batch_size, device=args.device, where=str(path))
    text = "".join(line + "\n" for line in out)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def cmd_generate(args) -> int:
    import torch

    from memattn.data import Vocab
    from memattn.generate import generate
    from memattn.train import model_from_checkpoint

    from memattn.errors import ConfigError

    if args.tokens < 0:
        raise ConfigError(f"--tokens: expected a number of tokens >= 0, got {args.tokens}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k: expected k >= 0 (0: sample from all), got {args.top_k}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ConfigError(f"--temperature: expected a finite number >= 0 (0: greedy), got {args.temperature}")
    check_device(args.device)
    model, cfg, vocab_json = model_from_checkpoint(args.checkpoint, args.device)
    if cfg.task != "lm" or not hasattr(model, "init_cache"):
        raise ConfigError(f"{args.checkpoint}: a {cfg.task} run{' of a converted model' if cfg.task == 'lm' else ''}; "
                          "memattn generate continues memattn's causal language models (translate a "
                          "translation run with memattn translate)")
    vocab = Vocab.from_json(vocab_json)
    if vocab.kind == "char":
        known = set(vocab.symbols) - ({vocab.symbols[vocab.unk_id]} if vocab.unk_id is not None else set())
        unknown = sorted(set(args.prompt) - known)
        if unknown:
            if vocab.unk_id is None:
                raise ConfigError(f"--prompt: characters not in the model's vocabulary: {''.join(unknown)!r}")
            print(f"memattn generate: note: the model does not know {''.join(unknown)!r}; read as its "
                  "unknown symbol", file=sys.stderr)
    prompt = torch.as_tensor(vocab.encode(args.prompt), dtype=torch.long, device=args.device)
    if prompt.numel() == 0:
        raise MemattnError("--prompt: needs at least one character")
    ids = prompt.tolist()
    shown = vocab.decode(ids)  # the text written so far, as the vocabulary reads it
    if vocab.kind == "pretrained" and shown != args.prompt:  # a tokenizer that normalises, or <unk>
        print(f"memattn generate: note: the model's tokenizer reads the prompt as {shown!r}", file=sys.stderr)
    sys.stdout.write(args.prompt)
    start = time.perf_counter()
    for token in generate(model, prompt[None], args.tokens, temperature=args.temperature,
                          top_k=args.top_k, seed=args.seed, compile=args.compile):
        ids.extend(token.tolist())
        # Decoded after what precedes it, a subword keeps its leading space and a byte joins
        # the character it belongs to; an unfinished character (U+FFFD last) waits a token.
        text = vocab.decode(ids)
        if text.endswith("\ufffd"):
            continue
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else vocab.decode(token.tolist()))
        sys.stdout.flush()
        shown = text
    text = vocab.decode(ids)
    if text != shown:
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else "")
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{args.tokens} tokens in {elapsed:.2f}s, {args.tokens / elapsed:,.1f} tokens/s]", file=sys.stderr)
    return 0


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


def check_device(name: str) -> None:
    """ConfigError for a device torch cannot use here (e.g. cuda without a GPU)."""
    import torch

    from memattn.errors import ConfigError

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device: {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device: {name!r} asked for, but no CUDA device is available")


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

    words = [o for o in args.overrides if "=" not in o]
    if len(words) == 1 and not args.checkpoint and Path(words[0]).exists():  # memattn info RUN
        args.checkpoint = words[0]
        args.overrides.remove(words[0])
    if args.checkpoint:
        from memattn.errors import ConfigError
        from memattn.train import model_from_checkpoint

        if args.overrides:
            raise ConfigError(f"info: {' '.join(args.overrides)}: a checkpoint is described as it was "
                              "saved; key=value overrides describe a model built from --config")
        model, cfg, _ = model_from_checkpoint(args.checkpoint)
    else:
        cfg = _run_config(args)
        vocab = cfg.model.vocab_size or 256
        model = CausalLM(dataclasses.replace(cfg.model, vocab_size=vocab)).eval()
    causal = cfg.task == "lm" and hasattr(model, "init_cache")  # a memattn causal LM decodes
    fixed, per_token = (state_memory(model, (min(64, cfg.model.max_len // 2), min(128, cfg.model.max_len)))
                        if causal else (None, None))
    m = cfg.model
    info = {
        "task": cfg.task, "attention": m.attention.name, "options": m.attention.options,
        "parameters": model.num_parameters(), "layers": m.n_layers, "d_model": m.d_model,
        "heads": m.n_heads, "positions": m.positions, "vocab_size": model.cfg.vocab_size if hasattr(model, "cfg") else m.vocab_size,
        "state_fixed_bytes": fixed, "state_bytes_per_token": per_token,
    }
    spans = learned_spans(model)
    if spans:  # adaptive attention span: z per head (tokens), per layer
        info["spans"] = {str(i): [round(z, 1) for z in zs] for i, zs in enumerate(spans) if zs}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"attention      {info['attention']} {info['options'] or ''}")
    print(f"parameters     {info['parameters']:,}")
    if causal or cfg.task != "lm":  # a converted model's shape is its own config's
        print(f"shape          {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, "
              f"{m.positions} positions, vocabulary {info['vocab_size']}")
    if causal:
        print(f"decoding state {fixed:,} bytes fixed + {per_token:,.0f} bytes per token of context"
              f" (batch 1, fp32{'; constant in context length' if per_token == 0 else ''})")
    else:
        print(f"task           {cfg.task}" + (" (a converted transformers model)" if cfg.task == "lm" else ""))
    for n, (i, zs) in enumerate(info.get("spans", {}).items()):
        print(f"{'learned spans' if n == 0 else '':<15}layer {i}: {', '.join(f'{z:g}' for z in zs)} tokens")
    if args.mechanisms:
        print(mechanism_table())
    elif not args.checkpoint:
        print("mechanisms     " + ", ".join(mechanisms()) + " (--mechanisms: their options)")
    return 0


def cmd_demo(args) -> int:
    from memattn.demo import run_demo

    from memattn.errors import ConfigError

    if args.warm_steps < 0:
        raise ConfigError(f"--warm-steps: expected a number of steps >= 0, got {args.warm_steps}")
    if not args.contexts or min(args.contexts) < 1:
        raise ConfigError(f"--contexts: expected context lengths >= 1, got {args.contexts}")
    run_demo(args.config, args.overrides, mechanisms=args.attention, out_dir=args.out_dir,
             warm_steps=args.warm_steps, contexts=tuple(sorted(set(args.contexts))))
    return 0


def cmd_experiment(args) -> int:
    from memattn.experiments import get_experiment

    module = get_experiment(args.name)
    out_dir = Path(args.out_dir or f"results/{args.name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "command.txt").write_text(args.command_line + "\n")
    module.run(out_dir, quick=args.quick, overrides=args.overrides, jobs=args.jobs)
    return 0


def new_folder(path: str) -> Path:
    """The `-o` folder of a command that writes a model: new or empty, else ConfigError."""
    from memattn.errors import ConfigError

    out = Path(path)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"-o: {out} is not empty; choose a new folder")
    return out


def cmd_export_hf(args) -> int:
    from memattn.errors import ConfigError

    try:
        from memattn.integrations.export import export_run
    except ImportError as e:
        raise ConfigError(str(e)) from None

    out = new_folder(args.out)
    auto = export_run(args.run, out)
    print(f"memattn export-hf: wrote {out} (config.json, model.safetensors, the tokenizer, a model card); "
          f"load it with AutoTokenizer and {auto}.from_pretrained after `import memattn.integrations.hf` "
          "(or with trust_remote_code=True)", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from memattn.errors import ConfigError
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
    out = new_folder(args.out)
    had_tokenizer = convert_pretrained(args.model, args.attention, options, layers, out)
    kept = ("with its tokenizer" if had_tokenizer
            else "without a tokenizer (the source has none; give data.tokenizer= to train it)")
    print(f"memattn convert: wrote {out} {kept}; load it with transformers' Auto classes after "
          "`import memattn.integrations.hf` (or with trust_remote_code=True), or train on with "
          f"`memattn train train.init_from={out}`", file=sys.stderr)
    return 0


def cmd_compress(args) -> int:
    from memattn.data import Vocab
    from memattn.errors import ConfigError
    from memattn.models.compressor import compress_ids, fingerprint, load_compressor, save_compressed

    model, meta = load_compressor(args.checkpoint)
    vocab = Vocab.from_json(meta["vocab"])
    source = Path(args.input)
    if not source.is_file():
        raise ConfigError(f"input: no such file {source}")
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"input: {source} is not UTF-8 text (byte {e.start} cannot be read)") from None
    seq_len = args.seq_len or int(meta["seq_len"])
    memory, lengths = compress_ids(model, vocab.encode(text), seq_len=seq_len, batch_size=args.batch_size)
    if args.half:
        memory = memory.half()
    save_compressed(args.out, memory, lengths, model_fingerprint=fingerprint(model), seq_len=seq_len,
                    characters=len(text), tokens=int(lengths.sum()), num_memory=model.num_memory, d_model=model.cfg.d_model)
    stored = memory.numel() * memory.element_size()
    print(f"{len(text):,} characters -> {memory.shape[0]} sequences x {memory.shape[1]} vectors x "
          f"{memory.shape[2]} ({stored:,} bytes of {str(memory.dtype).replace('torch.', '')}) in {args.out}")
    return 0


def cmd_decompress(args) -> int:
    from memattn.data import Vocab
    from memattn.errors import CheckpointError
    from memattn.models.compressor import (check_compressed, decompress_ids, fingerprint, load_compressed,
                                           load_compressor)

    compressed = load_compressed(args.compressed)
    model, meta = load_compressor(args.checkpoint)
    if compressed.meta.get("model") != fingerprint(model):
        raise CheckpointError(f"compressed file {args.compressed} was made by another model than "
                              f"{args.checkpoint} (their fingerprints differ)")
    check_compressed(compressed, model, args.compressed)
    vocab = Vocab.from_json(meta["vocab"])
    ids = decompress_ids(model, compressed.memory, compressed.lengths, n_symbols=vocab.size,
                         batch_size=args.batch_size)
    text = vocab.decode(ids)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"{len(text):,} characters from {compressed.memory.shape[0]} sequences -> {args.out}",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_bench(args) -> int:
    import shlex

    import torch

    from memattn.bench import make_settings, run_benchmarks
    from memattn.bench.timing import reexec_tuned

    names, settings = make_settings(
        args.targets, attention=args.attention or [], device=args.device, dtype=args.dtype,
        quick=args.quick, out=args.out, repeats=args.repeats, warmup=args.warmup,
        threads=args.threads, command=args.command_line, progress=not args.quiet)
    from_command_line = sys.argv[1:] == shlex.split(args.command_line)[1:]
    if settings.device.type == "cpu" and from_command_line and not args.no_env_tuning:
        reexec_tuned([sys.executable, "-m", "memattn", *sys.argv[1:]])  # returns when already tuned
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    for name, paths in run_benchmarks(names, settings).items():
        print(f"{name}: " + ", ".join(str(p) for p in paths))
    print(f"[{len(names)} benchmark(s) in {time.perf_counter() - start:.0f} s on {settings.device}, "
          f"{args.dtype}, {torch.get_num_threads()} threads]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memattn", description=(
        "Attention over a memory: train, evaluate and sample language models whose attention "
        "is any registered mechanism (see `memattn info`)."))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(sp, default="demo"):
        sp.add_argument("--config", default=default,
                        help=f"preset name in configs/ or a YAML file (default: {default})")
        sp.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)

    t = sub.add_parser("train", help="train a causal LM or a translation model (under torchrun: data-parallel)",
                       description="Train a causal LM (or, with task=translation / --config translation, "
                       "an encoder-decoder on parallel data) from a preset and overrides. Writes "
                       "checkpoint.safetensors, log.jsonl, config.yaml and summary.json to "
                       "train.out_dir. Data-parallel with `torchrun --nproc_per_node=N -m memattn train ...`.")
    with_config(t)
    t.add_argument("--resume", action="store_true",
                   help="continue from train.out_dir/checkpoint.safetensors (same losses as an uninterrupted run)")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the run in train.out_dir (without it, or --resume, an existing run is refused)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="bits per character and perplexity of a checkpoint",
                       description="Evaluate a checkpoint on a split of its corpus.")
    e.add_argument("checkpoint", help="checkpoint file or run folder")
    e.add_argument("--split", choices=("train", "val", "test"), default="test",
                   help="which split of the corpus (default: %(default)s)")
    e.add_argument("--seq-len", type=int, default=0, help="window length (default: the training seq_len)")
    e.add_argument("--batch-size", type=int, default=16, help="windows per forward pass")
    e.add_argument("--batches", type=int, default=0, help="evaluate only the first N batches (default: all)")
    e.add_argument("--context", type=int, default=0,
                   help="tokens read before each scored segment but not scored (default: 0)")
    e.add_argument("--stream", action="store_true",
                   help="read the split as --batch-size contiguous streams in one pass, each layer's "
                   "fixed-size state carried from segment to segment (bounded mechanisms only)")
    e.add_argument("--beam", type=int, default=5, help="translation runs: beam size (1: greedy)")
    e.add_argument("--length-penalty", type=float, default=0.6,
                   help="translation runs: GNMT length penalty alpha (default: %(default)s)")
    e.add_argument("--lengths", metavar="N,N,...",
                   help="quality by length: read documents of the longest N tokens and report bits per "
                   "character by position ([0, seq_len), then doubling) and over the first N tokens of "
                   "each; bounded mechanisms stream through their fixed state, others read one window "
                   "(language models only; e.g. 512,2048,8192,32768)")
    e.add_argument("--streams", type=int, help="with --lengths: documents read (default: 1)")
    e.add_argument("--chunk", type=int,
                   help="with --lengths: tokens per call of a streamed read (default: the training seq_len)")
    e.add_argument("--max-window", type=int,
                   help="with --lengths: longest window a growing-state model (softmax) reads; longer "
                   "lengths are reported as not read (default: 16384)")
    e.add_argument("--plot", metavar="FILE.png", help="with --lengths: plot bits per character against position")
    e.add_argument("--quiet", action="store_true", help="with --lengths: no progress bar")
    e.add_argument("--device", default="cpu", help="torch device to run on")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval)

    tr = sub.add_parser("translate", help="translate a file of sentences with a translation run",
                        description="Translate each line of --input (batched greedy or beam search "
                        "through the decoder's cache; bounded memories stay fixed in size).")
    tr.add_argument("run", help="checkpoint file or run folder of a translation run")
    tr.add_argument("--input", required=True, help="text file, one source sentence a line")
    tr.add_argument("--output", help="write the translations here (default: standard output)")
    tr.add_argument("--beam", type=int, default=5, help="beam size (1: greedy; default: %(default)s)")
    tr.add_argument("--length-penalty", type=float, default=0.6,
                    help="GNMT length penalty alpha, ((5 + length) / 6) ** alpha (default: %(default)s)")
    tr.add_argument("--max-len", type=int, default=0, help="longest output in tokens (default: twice the longest source of its batch plus 10, at most model.max_len - 1)")
    tr.add_argument("--batch-size", type=int, default=32, help="sentences decoded together")
    tr.add_argument("--device", default="cpu", help="torch device to run on")
    tr.set_defaults(fn=cmd_translate)

    g = sub.add_parser("generate", help="stream a sample from a checkpoint",
                       description="Continue a prompt, streaming characters as they are sampled; "
                       "the prompt is read once into each layer's decoding state.")
    g.add_argument("checkpoint", help="checkpoint file or run folder")
    g.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    g.add_argument("--tokens", type=int, default=500, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--compile", action="store_true",
                   help="decode through torch.compile (compiles first: tens of seconds on a CPU)")
    g.add_argument("--device", default="cpu", help="torch device to run on")
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("info", help="parameters and decoding-state memory of a model",
                       description="Describe a checkpoint, or a model built from a config: "
                       "parameters, shape and the memory its decoding state holds per token.")
    i.add_argument("--checkpoint", help="checkpoint file or run folder (default: build from --config); "
                   "`memattn info RUN` also names one")
    with_config(i)
    i.add_argument("--mechanisms", action="store_true", help="also list the registered mechanisms")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(fn=cmd_info)

    d = sub.add_parser("demo", help="the main job: prepare the corpus, train, evaluate, generate, compare",
                       description="Prepare the default corpus, train softmax attention, start each "
                       "other mechanism from it (train.init_from) and train it on, evaluate every "
                       "model on the test split, generate a sample, and compare quality, speed and "
                       "the decoding cost and state at growing contexts (a table and a plot).")
    with_config(d)
    d.add_argument("--attention", nargs="+", default=["softmax", "abc-mlp"],
                   help="mechanisms to compare, the baseline first (default: %(default)s)")
    d.add_argument("--warm-steps", type=int, default=200,
                   help="steps each other mechanism trains after starting from the baseline; 0: "
                   "train it from scratch with the baseline's budget (default: %(default)s)")
    d.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384],
                   help="context lengths at which decoding cost and state are measured (default: %(default)s)")
    d.add_argument("--out-dir", default="runs/demo", help="where runs and summary.json go (default: %(default)s)")
    d.set_defaults(fn=cmd_demo)

    x = sub.add_parser("experiment", help="reproduce a paper's experiment, small",
                       description="Run one of the papers' experiments and write its results "
                       "table under results/NAME/ (with the command that made it). "
                       "Experiments: " + _experiment_list())
    x.add_argument("name", help="which experiment")
    x.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    x.add_argument("--out-dir", help="where results go (default: results/NAME)")
    x.add_argument("--quick", action="store_true", help="a small smoke run, about a minute on a CPU")
    x.add_argument("--jobs", type=int, default=1,
                   help="models trained at once, one thread each (experiments that train models "
                   "in run folders: abc-lm, persistent-lm); running the command again continues "
                   "unfinished models and reuses finished ones")
    x.set_defaults(fn=cmd_experiment)

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
    cv.add_argument("--attention", required=True, help="the mechanism (memattn info --mechanisms)")
    cv.add_argument("overrides", nargs="*", metavar="attention.OPTION=VALUE",
                    help="options of the mechanism, e.g. attention.num_slots=32")
    cv.add_argument("--layers", default="", help="comma-separated layer numbers to convert (default: all)")
    cv.add_argument("-o", "--out", required=True, help="folder to write (new or empty)")
    cv.set_defaults(fn=cmd_convert)

    c = sub.add_parser("compress", help="compress a text into M memory vectors per sequence",
                       description="Cut a text into sequences, compress each into the M memory "
                       "vectors of a compressor checkpoint (GMAT sequence compression) and write "
                       "them as one safetensors file. `memattn decompress` rebuilds the text from "
                       "that file and the checkpoint alone.")
    c.add_argument("checkpoint", help="compressor checkpoint (e.g. from `memattn experiment gmat-mlm`)")
    c.add_argument("input", help="UTF-8 text file to compress")
    c.add_argument("-o", "--out", required=True, help="compressed file to write (.safetensors)")
    c.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: the training length)")
    c.add_argument("--half", action="store_true", help="store the vectors in float16 (half the bytes)")
    c.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    c.set_defaults(fn=cmd_compress)

    dc = sub.add_parser("decompress", help="rebuild a text from its compressed memory vectors",
                        description="Read a file written by `memattn compress` and rebuild every "
                        "position of every sequence from its M memory vectors (the original text "
                        "is not needed), with the compressor checkpoint that made it.")
    dc.add_argument("compressed", help="file written by `memattn compress`")
    dc.add_argument("--checkpoint", required=True, help="the compressor checkpoint that made the file")
    dc.add_argument("-o", "--out", help="text file to write (default: standard output)")
    dc.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    dc.set_defaults(fn=cmd_decompress)

    b = sub.add_parser("bench", help="measure every mechanism against softmax: decode, encode, train, lookup",
                       description="Measure every registered attention mechanism side by side against "
                       "softmax attention in one run, and write BENCHMARK.json, BENCHMARK.md (every "
                       "figure with its ratio to softmax) and BENCHMARK.png under --out. decode: per-token "
                       "latency and decoding-state bytes against context; encode: time and peak memory "
                       "to encode a batch; train: forward+backward tokens/s against length (a layer, a "
                       "small LM, the ABC op and its flash-linear-attention peer); lookup: per-query "
                       "cost of linear attention's stored C against softmax over the stored states. "
                       "Sizes are presets for the device (and --quick); change them with "
                       "SECTION.FIELD=VALUE, e.g. decode.contexts=[256,4096] decode.batch=8 lm.d_model=256 "
                       "(sections: lm, decode, encode, train, lookup).")
    b.add_argument("targets", nargs="*", metavar="BENCHMARK|KEY=VALUE",
                   help="decode, encode, train, lookup or all (default: all), and SECTION.FIELD=VALUE "
                   "size overrides")
    b.add_argument("--quick", action="store_true",
                   help="small sizes: all four benchmarks in under 2 minutes on a CPU")
    b.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    b.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="dtype of the models and inputs (default: %(default)s)")
    b.add_argument("--attention", nargs="+", metavar="NAME[:OPTION=VALUE,...]",
                   help="mechanisms to measure, at their default options or those given (e.g. "
                   "abc-meanpool:pool=512); default: every registered one. Softmax always runs as the baseline")
    b.add_argument("--out", help="output folder (default: benchmarks/results/DEVICE, or "
                   "benchmarks/results/DEVICE/quick with --quick; DEVICE is cpu or the GPU's name)")
    b.add_argument("--repeats", type=int, help="timed calls per configuration, the median reported "
                   "(default: 5, 3 with --quick; decode times decode.steps greedy steps instead)")
    b.add_argument("--warmup", type=int, help="untimed calls (decode: steps) before timing (default: 1)")
    b.add_argument("--threads", type=int, default=0, help="torch threads on CPU (default: torch's choice)")
    b.add_argument("--no-env-tuning", action="store_true",
                   help="on CPU, do not re-run with OMP_WAIT_POLICY=PASSIVE and the glibc malloc settings "
                   "of memattn.bench.timing.ENV (measure the environment as it is)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(fn=cmd_bench)
    return p


def _experiment_list() -> str:
    from memattn.experiments import experiments

    return "; ".join(f"{name}: {m.DESCRIPTION}" for name, m in experiments().items()) or "none yet"


def main(argv: list[str] | None = None) -> int:
    import shlex

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also come after the flags (`experiment NAME --quick steps=10`)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.command_line = shlex.join(["memattn", *argv])
    try:
        return args.fn(args)
    except MemattnError as e:
        print(f"memattn {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"memattn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`memattn info | head -2`): stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
