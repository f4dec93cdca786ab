"""research.bench.peers: peer libraries skipped with their reasons where missing, their rows
and memattn/peer ratios in the benchmark tables, and each installed peer computing memattn's
function (`make setup` installs all but pytorch-fast-transformers; benchmarks/peers_setup.sh
builds that one too)."""

import json
import sys

import pytest
import torch

from research.bench import peers
from research.bench.report import Metric, Result, Row, Section, add_ratios, fmt_rate, markdown
from research.bench.settings import LMShape
from memattn.cli import main
from memattn.layers.base import LayerSpec, build_attention
from memattn.ops import abc_attention

PEER_MODULES = ("x_transformers", "local_attention", "fast_transformers", "fla")
TINY = ["lm.d_model=16", "lm.n_layers=1", "lm.n_heads=2", "lm.vocab_size=32", "decode.contexts=[16]",
        "decode.batch=2", "decode.steps=2", "decode.prefill_chunk=8", "train.lengths=[16]",
        "train.tokens=32", "train.slots=4"]
MECHANISMS = ("persistent", "gmat", "abc-window", "linear")


@pytest.fixture
def no_peers(monkeypatch):
    """Every peer library missing, as on a machine without them (`import` raises ImportError)."""
    for name in [m for m in sys.modules if m.split(".")[0] in PEER_MODULES]:
        monkeypatch.delitem(sys.modules, name)
    for name in PEER_MODULES:
        monkeypatch.setitem(sys.modules, name, None)


def rows(result, section=None, label=None):
    return [r for r in result["rows"] if (section is None or r["section"] == section)
            and (label is None or r["label"] == label)]


def test_missing_peers_are_skipped_rows_with_their_reason(no_peers, tmp_path):
    assert main(["bench", "decode", "train", "--attention", *MECHANISMS, *TINY, "--quick", "--quiet",
                 "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    decode = json.loads((tmp_path / "decode.json").read_text())
    train = json.loads((tmp_path / "train.json").read_text())
    libraries = {"persistent": "x-transformers", "gmat": "x-transformers", "abc-window": "local-attention",
                 "linear": "pytorch-fast-transformers"}
    for peer in peers.PEERS:
        assert peer.label.endswith("(peer)")
        library = libraries[peer.mechanism]
        skipped = rows(decode, label=peer.label) + rows(train, section="lm", label=peer.label)
        assert len(skipped) == 2 and all(r["status"] == "skipped" for r in skipped), skipped
        assert all(f"{library} is not installed" in r["reason"] and r["versus"] == peer.mechanism
                   for r in skipped)
        layer = rows(train, section="layer", label=peer.label)
        assert [r["status"] for r in layer] == ["skipped"]
        assert (library if peer.lm is None else "in its model") in layer[0]["reason"]
    naive = rows(train, section="op", label=peers.FLA_NAIVE_ABC)
    assert [r["status"] for r in naive] == ["skipped"] and "flash-linear-attention is not installed" in naive[0]["reason"]
    # memattn's own rows ran, and the tables list the peers as skipped
    assert all(r["status"] == "ok" for m in MECHANISMS for r in rows(decode, label=m))
    md = (tmp_path / "decode.md").read_text()
    assert "- x-transformers num_mem_kv (peer): x-transformers is not installed" in md
    assert "memattn against its peers" not in md  # no peer row ran


@pytest.mark.parametrize("peer_name, mechanism, options, says", [
    ("x-transformers num_mem_kv", "persistent", {"variant": "attn-split"}, "all-attn variant"),
    ("x-transformers num_mem_kv", "persistent", {"relative_positions": True}, "relative_positions=True"),
    ("fast-transformers linear", "linear", {"feature_map": "identity", "normalize": False}, "feature_map=identity"),
    ("x-transformers memory tokens", "gmat", {}, "not in an attention layer"),
])
def test_options_a_peer_does_not_compute_are_skipped_before_it_is_imported(no_peers, peer_name, mechanism,
                                                                           options, says):
    peer = next(p for p in peers.peers_of(mechanism) if p.name == peer_name)
    with pytest.raises(peers.PeerUnavailable, match=says):
        peer.layer(LayerSpec(16, 2), options)


def test_missing_fla_gives_a_reason(no_peers):
    op, why = peers.fla_naive_abc(torch.device("cpu"))
    assert op is None and "flash-linear-attention is not installed" in why


def test_peer_ratios_divide_memattn_by_the_peer_in_the_same_section_and_x():
    rs = [Row("layer", "softmax", "softmax", x=8, metrics={"tokens_per_s": 100.0}),
          Row("layer", "linear", "linear", x=8, metrics={"tokens_per_s": 300.0}),
          Row("layer", "lin (peer)", "linear", x=8, metrics={"tokens_per_s": 200.0}, versus="linear"),
          Row("layer", "lin (peer)", "linear", x=16, status="skipped", reason="not installed", versus="linear"),
          Row("lm", "lin (peer)", "linear", x=8, metrics={"tokens_per_s": 50.0}, versus="linear")]
    add_ratios(rs)
    assert rs[2].memattn_over_peer == {"tokens_per_s": 1.5} and rs[2].vs_softmax == {"tokens_per_s": 2.0}
    assert rs[3].memattn_over_peer == {} and rs[4].memattn_over_peer == {}  # no memattn row in lm
    metric = (Metric("tokens_per_s", "tokens/s", fmt_rate),)
    result = Result("train", "t", "i", [Section("layer", "One layer", "", metric, "length")],
                    {"command": "memattn bench train", "device": "cpu", "cpu": "c", "dtype": "fp32",
                     "threads": 1, "torch": "2", "memattn": "0", "python": "3", "repeats": 1,
                     "warmup": 0, "env": {}}, {}, rs)
    md = markdown(result)
    assert "## memattn against its peers" in md and "| linear / lin (peer) | 1.50× |" in md
    assert "| lin (peer) | 200 (2.00×) |" in md


# Each installed peer computes the function of the memattn mechanism it is measured against.
# ------------------------------------------------------------------------------------------

B, T, H, D = 2, 40, 2, 8
DM = H * D


def decode_outputs(layer, x, prefill):
    """Outputs of `layer` reading x [B, T, d]: `prefill` tokens in one call, then one a call."""
    state = layer.init_state(x.shape[0])
    outs = [layer(x[:, :prefill], memory_state=state)[0]]
    for t in range(prefill, x.shape[1]):
        outs.append(layer(x[:, t:t + 1], memory_state=state)[0])
    return torch.cat(outs, 1)


@torch.no_grad()
def test_x_transformers_num_mem_kv_computes_persistent_all_attn():
    pytest.importorskip("x_transformers")
    N = 5
    spec = LayerSpec(DM, H, causal=True)
    mine = build_attention("persistent", {"n_persistent": N}, spec).eval()
    peer = peers.peers_of("persistent")[0].layer(spec, {"n_persistent": N}).eval()
    q, k, v = mine.qkv.weight.split(DM)
    a = peer.attn
    a.to_q.weight.copy_(q), a.to_k.weight.copy_(k), a.to_v.weight.copy_(v)
    a.to_out.weight.copy_(mine.out.weight)
    pk, pv = mine.persistent()
    a.mem_k.copy_(pk), a.mem_v.copy_(pv)
    x = torch.randn(B, T, DM)
    y = mine(x)[0]
    torch.testing.assert_close(peer(x)[0], y, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(decode_outputs(peer, x, 17), y, atol=1e-5, rtol=1e-4)
    state = peer.init_state(B)
    peer(x, memory_state=state)
    assert state.nbytes() == 2 * B * H * T * D * 4 and not state.fixed_size  # every past key and value


@torch.no_grad()
def test_local_attention_computes_abc_window():
    pytest.importorskip("local_attention")
    n = 6
    spec = LayerSpec(DM, H, causal=True)
    mine = build_attention("abc-window", {"window": n}, spec).eval()
    peer = peers.peers_of("abc-window")[0].layer(spec, {"window": n}).eval()
    peer.attn.to_qkv.weight.copy_(mine.qkv.weight)
    peer.attn.to_out.weight.copy_(mine.out.weight)
    x = torch.randn(B, T, DM)
    y = mine(x)[0]
    torch.testing.assert_close(peer(x)[0], y, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(decode_outputs(peer, x, 13), y, atol=1e-5, rtol=1e-4)
    state = peer.init_state(B)
    peer(x[:, :13], memory_state=state)
    sizes = [state.nbytes()]
    for t in range(13, T):
        peer(x[:, t:t + 1], memory_state=state)
        sizes.append(state.nbytes())
    # the last n keys and values in fp32, however many tokens were read
    assert sizes == [2 * B * H * n * D * 4] * (T - 12) and state.fixed_size


@torch.no_grad()
def test_fast_transformers_computes_linear():
    pytest.importorskip("fast_transformers.causal_product")
    spec = LayerSpec(DM, H, causal=True)
    mine = build_attention("linear", {}, spec).eval()
    peer = peers.peers_of("linear")[0].layer(spec, {}).eval()
    q, k, v = mine.qkv.weight.split(DM)
    f = peer.full
    for proj, w in ((f.query_projection, q), (f.key_projection, k), (f.value_projection, v),
                    (f.out_projection, mine.out.weight)):
        proj.weight.copy_(w)
        proj.bias.zero_()
    x = torch.randn(B, T, DM)
    y = mine(x)[0]
    torch.testing.assert_close(peer(x)[0], y, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(decode_outputs(peer, x, 11), y, atol=1e-5, rtol=1e-4)
    state = peer.init_state(B)
    peer(x, memory_state=state)
    assert state.nbytes() == B * H * (D * D + D) * 4 and state.fixed_size  # S and Z


def test_fla_naive_recurrent_abc_computes_abc_attention():
    pytest.importorskip("fla")
    op, why = peers.fla_naive_abc(torch.device("cpu"))
    assert op is not None, why
    M = 4
    q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
    s = torch.randn(B, T, H, M, requires_grad=True)
    mine = abc_attention(q, k, v, s, causal=True)[0]
    theirs = op(q, k, v, s)
    torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=1e-4)
    do = torch.randn_like(mine)
    for a, b in zip(torch.autograd.grad(mine, (q, k, v, s), do), torch.autograd.grad(theirs, (q, k, v, s), do)):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-3)


@torch.no_grad()
def test_x_transformers_memory_tokens_turn_its_cache_off_and_decode_by_rerunning():
    pytest.importorskip("x_transformers")
    shape = LMShape(d_model=DM, n_layers=1, n_heads=H, vocab_size=32)
    lm = peers.peers_of("gmat")[0].lm(shape, {"num_memory": 3, "chunk_size": 8}).eval()
    assert lm.net.can_cache_kv is False  # the fact the notes quote
    ids = torch.randint(0, 32, (B, 20))
    cache = lm.init_cache(B)
    steps = [lm(ids[:, :12], cache=cache)] + [lm(ids[:, t:t + 1], cache=cache) for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), lm(ids), atol=1e-5, rtol=1e-4)
    assert cache.nbytes() == B * 20 * 8  # the token ids
