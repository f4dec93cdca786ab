"""memattn.representations: encode / save / load / lookup of fixed-size document memories."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from memattn.errors import ShapeError
from memattn.representations import (FORMAT, RepresentationError, Representations, encode,
                                     load, lookup, save)

F64 = torch.float64


def documents(N=3, T=17, K=6, dtype=torch.float32, seed=0):
    """States h [N, T, K] of N documents of different lengths, and their mask."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, T, K, generator=g, dtype=F64).to(dtype)
    lengths = torch.tensor([T, T - 5, 1][:N] + [T] * max(0, N - 3))
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return h, mask, lengths


def test_memory_is_the_sum_of_outer_products_of_real_states():
    h, mask, lengths = documents(dtype=F64)
    reps = encode(h, mask=mask, meta={"encoder": "test"})
    assert reps.memory.shape == (3, 1, 6, 6) and reps.memory.dtype == F64
    for n in range(3):
        real = h[n, : lengths[n]]  # [t, K]
        torch.testing.assert_close(reps.memory[n, 0], real.T @ real, rtol=1e-12, atol=1e-12)
    assert reps.lengths.tolist() == lengths.tolist() and reps.meta == {"encoder": "test"}


def test_lookup_equals_c_q_by_plain_matmul():
    h, mask, lengths = documents(dtype=F64)
    reps = encode(h, mask=mask)
    q = torch.randn(3, 5, 6, dtype=F64)  # 5 queries a document
    r = lookup(reps, q)
    assert r.shape == (3, 5, 6)
    for n in range(3):
        real = h[n, : lengths[n]]
        C = sum(torch.outer(s, s) for s in real)  # the paper's C = Σ h hᵀ
        torch.testing.assert_close(r[n], (C @ q[n].T).T, rtol=1e-12, atol=1e-12)


def test_gated_memory_and_lookup():
    h, mask, lengths = documents(dtype=F64)
    gate = torch.nn.Linear(6, 6).double()
    reps = encode(h, gate=gate, mask=mask)
    q = torch.randn(3, 2, 6, dtype=F64)
    for n in range(3):
        real = h[n, : lengths[n]]
        f = torch.sigmoid(real @ gate.weight.T + gate.bias) * real  # f = σ(W h + b) ⊙ h
        C = f.T @ f
        torch.testing.assert_close(reps.memory[n, 0], C, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lookup(reps, q)[n], q[n] @ C.T, rtol=1e-12, atol=1e-12)


def test_separate_keys_values_and_heads():
    k = torch.randn(2, 9, 3, 4, dtype=F64)
    v = torch.randn(2, 9, 3, 5, dtype=F64)
    reps = encode(k, v)
    assert (reps.heads, reps.key_dim, reps.value_dim) == (3, 4, 5)
    q = torch.randn(2, 7, 3, 4, dtype=F64)
    r = lookup(reps, q)  # [N, Q, H, V]
    want = torch.einsum("nqhk,nthk,nthv->nqhv", q, k, v)  # Σ_t v_t (k_t · q)
    torch.testing.assert_close(r, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    h, mask, _ = documents(dtype=dtype)
    reps = encode(h, mask=mask, meta={"model": "x", "k": 6, "nested": {"a": [1, 2]}})
    reps.memory[0, 0, 0, 0] = -0.0  # a signed zero and a subnormal survive too
    reps.memory[0, 0, 0, 1] = torch.finfo(dtype).tiny / 4
    path = tmp_path / "docs.safetensors"
    save(path, reps)
    back = load(path)
    assert back.memory.dtype == dtype and back.memory.shape == reps.memory.shape
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(back.memory.view(bits), reps.memory.view(bits))
    assert torch.equal(back.lengths, reps.lengths) and back.meta == reps.meta
    q = torch.randn(3, 4, 6, dtype=dtype)
    assert torch.equal(lookup(back, q), lookup(reps, q))  # loaded = freshly encoded
    save(path, back)  # and again: the same bytes
    assert torch.equal(load(path).memory.view(bits), reps.memory.view(bits))


def test_subsets_and_size():
    h, mask, _ = documents(N=4)
    reps = encode(h, mask=mask)
    part = reps[[3, 0, 0]]
    assert torch.equal(part.memory[1], reps.memory[0]) and len(part) == 3
    assert reps.nbytes() == 4 * 6 * 6 * 4  # N·K·K fp32 numbers, whatever the lengths


def test_load_checks_what_the_caller_expects(tmp_path):
    path = tmp_path / "docs.safetensors"
    save(path, encode(documents()[0]))
    assert load(path, key_dim=6, dtype=torch.float32).key_dim == 6
    with pytest.raises(ShapeError, match=r"key_dim: expected representations with K = 8, .* holds K = 6"):
        load(path, key_dim=8)
    with pytest.raises(ShapeError, match=r"dtype: expected representations of dtype torch.float64, .* holds torch.float32"):
        load(path, dtype=F64)


def test_lookup_rejects_mismatched_queries():
    reps = encode(documents()[0])
    with pytest.raises(ShapeError, match=r"queries: expected \[N, Q, K\] with K = 6 \(the key dim"):
        lookup(reps, torch.randn(3, 2, 5))
    with pytest.raises(ShapeError, match=r"queries: expected \[N, Q, K\] with N = 3"):
        lookup(reps, torch.randn(2, 2, 6))
    with pytest.raises(ShapeError, match=r"queries: expected dtype torch.float32 \(that of the representations\), got torch.float64"):
        lookup(reps, torch.randn(3, 2, 6, dtype=F64))
    with pytest.raises(ShapeError, match=r"queries: expected dtype torch.float32 .* got torch.int64"):
        lookup(reps, torch.ones(3, 2, 6, dtype=torch.long))
    with pytest.raises(ShapeError, match=r"queries: expected \[N, Q, K\] or \[N, Q, H, K\]"):
        lookup(reps, torch.randn(3, 6))
    with pytest.raises(ShapeError, match=r"reps: expected Representations"):
        lookup(reps.memory, torch.randn(3, 2, 6))


def test_encode_and_construction_reject_bad_input():
    h, _, _ = documents()
    with pytest.raises(ShapeError, match=r"keys: expected a floating point tensor"):
        encode(torch.ones(2, 3, 4, dtype=torch.long))
    with pytest.raises(ShapeError, match=r"mask: expected dtype torch.bool"):
        encode(h, mask=torch.ones(3, 17))
    with pytest.raises(ShapeError, match=r"mask: expected \[N, T\]"):
        encode(h, mask=torch.ones(3, 16, dtype=torch.bool))
    with pytest.raises(ShapeError, match=r"values: the gated form"):
        encode(h, h, gate=torch.nn.Linear(6, 6))
    with pytest.raises(ShapeError, match=r"memory: expected dtype torch.float32 or torch.float64, got torch.float16"):
        Representations(torch.zeros(1, 1, 2, 2, dtype=torch.float16), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ShapeError, match=r"meta: expected a JSON-able dict"):
        Representations(torch.zeros(1, 1, 2, 2), torch.zeros(1, dtype=torch.long), {"x": object()})


def test_a_file_that_is_not_ours_is_a_clear_error(tmp_path):
    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(3, 3)}, str(foreign))
    with pytest.raises(RepresentationError, match=r"a safetensors file, but not a memattn representations file"):
        load(foreign)
    other = tmp_path / "other.safetensors"
    save_file({"memory": torch.zeros(1, 1, 2, 2)}, str(other),
              metadata={"memattn": json.dumps({"format": "memattn-checkpoint/1"})})
    with pytest.raises(RepresentationError, match=r"holds format 'memattn-checkpoint/1', expected "
                                                  + repr(FORMAT)):
        load(other)
    text = tmp_path / "notes.txt"
    text.write_text("not a tensor file at all")
    with pytest.raises(RepresentationError, match=r"not a readable safetensors file"):
        load(text)
    with pytest.raises(RepresentationError, match=r"path: no such file"):
        load(tmp_path / "missing.safetensors")
    with pytest.raises(RepresentationError, match=r"which is not a file"):
        load(tmp_path)


def test_a_file_altered_after_saving_is_a_clear_error(tmp_path):
    meta = {"format": FORMAT, "version": 1, "count": 1, "heads": 1, "key_dim": 2,
            "value_dim": 2, "dtype": "float64", "meta": {}}
    path = tmp_path / "altered.safetensors"
    save_file({"memory": torch.zeros(1, 1, 2, 2), "lengths": torch.ones(1, dtype=torch.long)},
              str(path), metadata={"memattn": json.dumps(meta)})
    with pytest.raises(RepresentationError, match=r"memory has dtype torch.float32, metadata says 'float64'"):
        load(path)
    save_file({"memory": torch.zeros(1, 1, 2, 3, dtype=F64), "lengths": torch.ones(1, dtype=torch.long)},
              str(path), metadata={"memattn": json.dumps(meta)})
    with pytest.raises(RepresentationError, match=r"memory has shape \(1, 1, 2, 3\), metadata says"):
        load(path)
    save_file({"memory": torch.zeros(1, 1, 2, 2, dtype=F64)}, str(path),
              metadata={"memattn": json.dumps(meta)})
    with pytest.raises(RepresentationError, match=r"expected tensors 'memory' and 'lengths'"):
        load(path)
    save_file({"memory": torch.zeros(1, 1, 2, 2, dtype=F64), "lengths": torch.ones(1, dtype=torch.long)},
              str(path), metadata={"memattn": json.dumps(dict(meta, version=2))})
    with pytest.raises(RepresentationError, match=r"version 2; this memattn reads version 1"):
        load(path)


def test_a_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "docs.safetensors"
    save(path, encode(documents()[0]))
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    for keep in (0, 5, 8, 40, len(data) // 2, len(data) - 1):
        cut.write_bytes(data[:keep])
        with pytest.raises(RepresentationError, match=r"not a readable safetensors file; truncated"):
            load(cut)


def test_save_is_atomic_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "docs.safetensors"
    save(path, encode(documents()[0]))
    assert [p.name for p in path.parent.iterdir()] == ["docs.safetensors"]
    with pytest.raises(ShapeError, match=r"reps: expected Representations"):
        save(path, torch.zeros(1))


def test_readme_snippet():
    """The usage snippet of the README section on fixed-size representations."""
    import tempfile
    from pathlib import Path

    from memattn import representations as docrep

    h = torch.randn(4, 300, 100)                 # states of 4 documents, k = 100
    reps = docrep.encode(h)                      # C = Σ h hᵀ: [4, 1, 100, 100], whatever T
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "docs.safetensors"
        docrep.save(path, reps)
        loaded = docrep.load(path, key_dim=100)
    q = torch.randn(4, 10, 100)                  # 10 queries for each document
    r = docrep.lookup(loaded, q)                 # C q: [4, 10, 100], O(k²) a query
    assert torch.equal(r, docrep.lookup(reps, q))
