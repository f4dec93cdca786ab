"""`memattn bench` (research.bench): state bytes against their closed forms, ratios to softmax,
the files and metadata written, failures recorded, peers skipped, one-line errors."""

import json

import pytest
import torch

from research.bench import report
from research.bench.peers import fla_chunk_abc
from research.bench.report import Row, add_ratios
from research.bench.settings import sizes_for
from research.bench.timing import failure
from memattn.cli import main
from memattn.layers.linear import LinearAttention

L, H, D, VOCAB = 2, 2, 8, 32  # the tiny LM: d_model = H * D
CONTEXTS, BATCH = (16, 48), 3
TINY = [f"lm.d_model={H * D}", f"lm.n_layers={L}", f"lm.n_heads={H}", f"lm.vocab_size={VOCAB}",
        f"decode.contexts=[{CONTEXTS[0]},{CONTEXTS[1]}]", f"decode.batch={BATCH}", "decode.steps=2",
        "decode.prefill_chunk=16", "encode.batch=2", "encode.length=32", "encode.d_model=16",
        "encode.n_layers=1", "encode.n_heads=2", "encode.slots=[4]", "train.lengths=[16,32]",
        "train.tokens=64", "train.slots=4", "lookup.lengths=[64,256]", "lookup.key_dim=8",
        "lookup.queries=4"]
SLOTS = 4  # abc-mlp's slots in the decode runs


def bench(out, *args):
    return main(["bench", *args, *TINY, "--quick", "--quiet", "--repeats", "1", "--out", str(out)])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One end-to-end run of every benchmark at a tiny size: {benchmark: parsed JSON}."""
    out = tmp_path_factory.mktemp("bench")
    assert bench(out, "all", "--attention", f"abc-mlp:num_slots={SLOTS}", "linear", "abc-workspace") == 0
    return out, {name: json.loads((out / f"{name}.json").read_text())
                 for name in ("decode", "encode", "train", "lookup")}


def rows(result, section=None, label=None):
    return [r for r in result["rows"] if (section is None or r["section"] == section)
            and (label is None or r["label"] == label)]


def test_decode_state_bytes_equal_their_closed_forms(results):
    decode = results[1]["decode"]
    for r in rows(decode, label="softmax"):
        c = r["x"]  # a KV cache: keys and values of every layer, head and past token, fp32
        assert r["metrics"]["state_bytes"] == 2 * L * H * D * c * 4 * BATCH
        assert r["metrics"]["state_bytes_per_sequence"] == 2 * L * H * D * c * 4
    abc = rows(decode, label=f"abc-mlp num_slots={SLOTS}")
    linear = rows(decode, label="linear")
    assert [r["x"] for r in abc] == list(CONTEXTS) and all(r["status"] == "ok" for r in abc + linear)
    # ABC: log-normaliser [B, H, M], K̃ [B, H, M, D], Ṽ [B, H, M, D] per layer, fp32, whatever the context
    assert {r["metrics"]["state_bytes"] for r in abc} == {L * BATCH * H * (SLOTS + 2 * SLOTS * D) * 4}
    # linear: C [B, H, D, D] and the normaliser z [B, H, D, 1] per layer
    assert {r["metrics"]["state_bytes"] for r in linear} == {L * BATCH * H * (D * D + D) * 4}
    assert all(r["metrics"]["seconds_per_token"] > 0 for r in abc + linear)


def test_ratios_are_to_softmax_at_the_same_x_in_the_same_section():
    rs = [Row("a", "softmax", "softmax", x=1, metrics={"t": 2.0, "b": 8}),
          Row("a", "m", "m", x=1, metrics={"t": 1.0, "b": 2}),
          Row("a", "softmax", "softmax", x=2, metrics={"t": 10.0}),
          Row("a", "m", "m", x=2, metrics={"t": 5.0}),
          Row("b", "m", "m", x=1, metrics={"t": 3.0}),  # no softmax in section b
          Row("a", "n", "n", x=1, status="oom")]
    add_ratios(rs)
    assert rs[0].vs_softmax == {"t": 1.0, "b": 1.0}
    assert rs[1].vs_softmax == {"t": 0.5, "b": 0.25}
    assert rs[3].vs_softmax == {"t": 0.5}
    assert rs[4].vs_softmax == {} and rs[5].vs_softmax == {}
    rs[0].status = "error"  # a failed baseline gives no ratio
    add_ratios(rs)
    assert rs[1].vs_softmax == {}


def test_written_ratios_divide_by_the_softmax_row_of_the_run(results):
    for result in results[1].values():
        base = {(r["section"], r["x"]): r for r in rows(result, label="softmax")}
        for r in result["rows"]:
            if r["status"] != "ok":
                continue
            ref = base[(r["section"], r["x"])]["metrics"]
            for key, ratio in r["vs_softmax"].items():
                assert ratio == pytest.approx(r["metrics"][key] / ref[key])
            assert set(r["vs_softmax"]) == set(r["metrics"]) & set(ref)


def test_json_markdown_and_png_are_written_with_the_run_metadata(results):
    out, parsed = results
    for name, result in parsed.items():
        meta = result["meta"]
        assert meta["device"] == "cpu" and meta["dtype"] == "fp32" and meta["quick"] is True
        assert meta["torch"] == torch.__version__ and meta["memattn"] and meta["python"]
        assert meta["cpu"] and meta["threads"] >= 1 and meta["wall_s"] >= 0
        assert meta["command"].startswith("memattn bench all ") and "decode.batch=3" in meta["command"]
        md = (out / f"{name}.md").read_text()
        assert meta["command"] in md and "ratio to softmax" in md and "| softmax |" in md
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert parsed["decode"]["settings"]["decode"]["batch"] == BATCH
    assert parsed["encode"]["settings"]["encode"]["length"] == 32


def test_every_chosen_mechanism_runs_or_is_skipped_with_a_reason(results):
    parsed = results[1]
    skipped = rows(parsed["decode"], label="abc-workspace")  # bidirectional only
    assert [r["status"] for r in skipped] == ["skipped"] and "bidirectional" in skipped[0]["reason"]
    assert "abc-workspace: bidirectional only" in (results[0] / "decode.md").read_text()
    encode = {r["label"]: r["status"] for r in parsed["encode"]["rows"]}
    # options given on the command line replace abc-mlp's sweep of encode.slots; abc-workspace,
    # named alone, is swept over its slots (encode.slots=[4])
    assert encode == {"softmax": "ok", f"abc-mlp num_slots={SLOTS}": "ok", "linear": "ok",
                      "abc-workspace num_slots=4": "ok"}
    assert all(r["metrics"]["peak_bytes"] > 0 for r in parsed["encode"]["rows"])
    lookup = {(r["label"], r["x"]) for r in parsed["lookup"]["rows"] if r["status"] == "ok"}
    assert lookup == {(m, n) for m in ("softmax", "linear") for n in (64, 256)}


def test_the_fla_peer_is_skipped_with_its_reason_on_cpu(results):
    op, why = fla_chunk_abc(torch.device("cpu"))
    assert op is None and "CUDA" in why
    fla = rows(results[1]["train"], section="op", label="chunk_abc (fla)")
    assert len(fla) == 2 and all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in fla)
    assert all(r["status"] == "ok" for r in rows(results[1]["train"], section="op", label="softmax"))


def test_out_of_memory_in_one_configuration_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    def no_memory(self, *args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 GB")

    monkeypatch.setattr(LinearAttention, "forward", no_memory)
    assert bench(tmp_path, "decode", "--attention", "linear", "abc-random") == 0
    result = json.loads((tmp_path / "decode.json").read_text())
    linear = rows(result, label="linear")
    assert [r["status"] for r in linear] == ["oom", "oom"]
    assert "can't allocate" in linear[0]["reason"] and "not run" in linear[1]["reason"]
    assert all(r["status"] == "ok" for r in rows(result, label="abc-random"))
    assert "| linear | oom | oom |" in (tmp_path / "decode.md").read_text()


def test_failures_are_told_apart():
    assert failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))[0] == "oom"
    assert failure(RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"))[0] == "oom"
    status, reason = failure(ValueError("x: expected [B, T, d]"))
    assert status == "error" and reason == "ValueError: x: expected [B, T, d]"


@pytest.mark.parametrize("args, message", [
    (["nonsense"], "unknown benchmark 'nonsense'"),
    (["decode", "--attention", "nonexistent"], "unknown mechanism 'nonexistent'"),
    (["decode", "--attention", "abc-mlp:slots=3"], "attention.slots: not an option of 'abc-mlp'"),
    (["decode", "decode.context=[1]"], "decode.context: unknown key of decode"),
    (["decode", "decode.batch=0"], "decode.batch: expected positive values"),
    (["decode", "--device", "tpu"], "--device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["decode", "--repeats", "0"], "--repeats: expected a number >= 1, got 0"),
])
def test_bad_input_is_one_line(args, message, capsys, tmp_path):
    assert main(["bench", *args, "--quick", "--quiet", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memattn bench: error: ") and message in err[0], err
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_one_line(capsys, tmp_path):
    assert main(["bench", "decode", "--device", "cuda", "--quiet", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device: cuda was asked for, but this machine has no CUDA GPU" in err[0]


def test_sizes_take_presets_then_typed_overrides():
    cpu = sizes_for(torch.device("cpu"), quick=False)
    assert cpu.decode.contexts[0] == 256 and cpu.decode.contexts[-1] == 32768
    quick = sizes_for(torch.device("cpu"), quick=True, overrides=["decode.contexts=[8,64]", "lm.ff_mult=2"])
    assert quick.decode.contexts == (8, 64) and quick.lm.ff_mult == 2.0
    assert report.fmt_bytes(3 * 2**20) == "3 MiB" and report.fmt_ratio(0.5) == "0.50×"
