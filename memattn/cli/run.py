"""`memattn train`, `eval`, `translate`, `generate`: a run trained, evaluated and used. What
each does with a run is asked of its task (memattn.tasks), never of the task's name."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from memattn.cli.common import (check_device, float_at_least, int_at_least, non_decoding_run, non_negative_int,
                                output_file, positive_int, progress_bar, read_text_input, run_config,
                                with_config)
from memattn.errors import ConfigError, MemattnError
from memattn.fileio import atomic_write_text


def cmd_train(args) -> int:
    from memattn.train import train

    cfg = run_config(args)
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
    from memattn.tasks import EvalOptions, task_class
    from memattn.train import model_from_checkpoint

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
    task = task_class(cfg.task)
    if lengths is not None and (other := non_decoding_run(model, cfg)):
        raise ConfigError(f"--lengths: measures memattn's causal language models; {args.checkpoint} is {other}")
    options = EvalOptions(checkpoint=args.checkpoint, split=args.split, seq_len=args.seq_len,
                          batch_size=args.batch_size, batches=args.batches, context=args.context,
                          stream=args.stream, beam=args.beam, length_penalty=args.length_penalty,
                          device=args.device)
    if lengths is not None:
        return eval_by_length(args, task, model, cfg, vocab, options, lengths)
    with progress_bar(f"eval {cfg.model.attention.name}", "window", quiet=args.json or args.quiet) as progress:
        result, line = task.evaluate_checkpoint(model, cfg, vocab, replace(options, progress=progress))
    print(json.dumps(result) if args.json else line)
    return 0


def parse_lengths(text: str) -> list[int]:
    """`--lengths 512,2048,8192`: positive numbers of tokens, else ConfigError."""
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"--lengths: expected positive numbers of tokens separated by commas "
                          f"(e.g. 512,2048,8192), got {text!r}")
    return sorted(set(lengths))


def eval_by_length(args, task, model, cfg, vocab, options, lengths) -> int:
    """`memattn eval --lengths`: bits per character by position bucket and over the first n tokens
    (the task's evaluate_by_length), as a table or JSON, and optionally a plot."""
    from memattn.evaluate import MAX_WINDOW, plot_by_length

    streams = args.streams or 1
    with progress_bar(f"eval {cfg.model.attention.name} by length", "token", quiet=args.json or args.quiet,
                      delay=0, unit_scale=True) as progress:
        result = task.evaluate_by_length(model, cfg, vocab, replace(options, progress=progress), lengths,
                                         streams=streams, chunk=args.chunk or 0,
                                         max_window=args.max_window or MAX_WINDOW)
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


def cmd_translate(args) -> int:
    from memattn.data import Vocab
    from memattn.tasks import task_class
    from memattn.train import model_from_checkpoint
    from memattn.translation import translate_texts

    check_device(args.device)
    path = Path(args.input)
    texts = read_text_input(path, "--input").splitlines()
    with output_file(args.output, "--output", {"the --input file": path, "the run": args.run}) as out:
        model, cfg, vocab_json = model_from_checkpoint(args.run, args.device)
        if not task_class(cfg.task).translates:
            raise ConfigError(f"{args.run}: a {cfg.task} run; `memattn translate` needs a translation run")
        translated = translate_texts(model, Vocab.from_json(vocab_json), texts, beam=args.beam,
                                     length_penalty=args.length_penalty, max_len=args.max_len,
                                     batch_size=args.batch_size, device=args.device, where=str(path))
        text = "".join(line + "\n" for line in translated)
        if out is not None:
            atomic_write_text(out, text)
        else:
            sys.stdout.write(text)
    return 0


def cmd_generate(args) -> int:
    import torch

    from memattn.data import Vocab
    from memattn.generate import generate
    from memattn.train import model_from_checkpoint

    check_device(args.device)
    model, cfg, vocab_json = model_from_checkpoint(args.checkpoint, args.device)
    other = non_decoding_run(model, cfg)
    if other:
        raise ConfigError(f"{args.checkpoint}: {other}; memattn generate continues memattn's causal language "
                          "models (translate a translation run with memattn translate)")
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


def add_commands(sub) -> None:
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
    e.add_argument("--seq-len", type=positive_int, help="window length (default: the training seq_len)")
    e.add_argument("--batch-size", type=positive_int, default=16, help="windows per forward pass")
    e.add_argument("--batches", type=non_negative_int, default=0,
                   help="evaluate only the first N batches (default: all)")
    e.add_argument("--context", type=int_at_least(0, "a number of tokens"), default=0,
                   help="tokens read before each scored segment but not scored (default: 0)")
    e.add_argument("--stream", action="store_true",
                   help="read the split as --batch-size contiguous streams in one pass, each layer's "
                   "fixed-size state carried from segment to segment (bounded mechanisms only)")
    e.add_argument("--beam", type=int_at_least(1, "a beam"), default=5,
                   help="translation runs: beam size (1: greedy)")
    e.add_argument("--length-penalty", type=float_at_least(0), default=0.6,
                   help="translation runs: GNMT length penalty alpha (default: %(default)s)")
    e.add_argument("--lengths", metavar="N,N,...",
                   help="quality by length: read documents of the longest N tokens and report bits per "
                   "character by position ([0, seq_len), then doubling) and over the first N tokens of "
                   "each; bounded mechanisms stream through their fixed state, others read one window "
                   "(language models only; e.g. 512,2048,8192,32768)")
    e.add_argument("--streams", type=positive_int, help="with --lengths: documents read (default: 1)")
    e.add_argument("--chunk", type=positive_int,
                   help="with --lengths: tokens per call of a streamed read (default: the training seq_len)")
    e.add_argument("--max-window", type=positive_int,
                   help="with --lengths: longest window a growing-state model (softmax) reads; longer "
                   "lengths are reported as not read (default: 16384)")
    e.add_argument("--plot", metavar="FILE.png", help="with --lengths: plot bits per character against position")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.add_argument("--device", default="cpu", help="torch device to run on")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval)

    tr = sub.add_parser("translate", help="translate a file of sentences with a translation run",
                        description="Translate each line of --input (batched greedy or beam search "
                        "through the decoder's cache; bounded memories stay fixed in size).")
    tr.add_argument("run", help="checkpoint file or run folder of a translation run")
    tr.add_argument("--input", required=True, help="text file, one source sentence a line")
    tr.add_argument("--output", help="write the translations here (default: standard output)")
    tr.add_argument("--beam", type=int_at_least(1, "a beam"), default=5,
                    help="beam size (1: greedy; default: %(default)s)")
    tr.add_argument("--length-penalty", type=float_at_least(0), default=0.6,
                    help="GNMT length penalty alpha, ((5 + length) / 6) ** alpha (default: %(default)s)")
    tr.add_argument("--max-len", type=positive_int,
                    help="longest output in tokens (default: twice the longest source of its batch plus 10, "
                    "at most model.max_len - 1)")
    tr.add_argument("--batch-size", type=positive_int, default=32, help="sentences decoded together")
    tr.add_argument("--device", default="cpu", help="torch device to run on")
    tr.set_defaults(fn=cmd_translate)

    g = sub.add_parser("generate", help="stream a sample from a checkpoint",
                       description="Continue a prompt, streaming characters as they are sampled; "
                       "the prompt is read once into each layer's decoding state.")
    g.add_argument("checkpoint", help="checkpoint file or run folder")
    g.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    g.add_argument("--tokens", type=int_at_least(0, "a number of tokens"), default=500, help="tokens to generate")
    g.add_argument("--temperature", type=float_at_least(0, note=" (0: greedy)"), default=0.8, help="0 for greedy")
    g.add_argument("--top-k", type=int_at_least(0, "k", " (0: sample from all)"), default=0,
                   help="sample among the k likeliest (0: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--compile", action="store_true",
                   help="decode through torch.compile (compiles first: tens of seconds on a CPU)")
    g.add_argument("--device", default="cpu", help="torch device to run on")
    g.set_defaults(fn=cmd_generate)
