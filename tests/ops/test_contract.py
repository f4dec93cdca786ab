"""memattn.ops.contract: every op of OP_BACKENDS keeps the one contract, on every backend it
declares that runs here (Triton under its interpreter on the CPU, tests/conftest.py): it
returns (o, state), state None or a NamedTuple laid out [B, H, ...] that initial_state takes
back; it refuses backends it does not have; bad input is a ShapeError naming the argument."""

from __future__ import annotations

import pytest
import torch

from memattn import ops
from memattn.errors import ConfigError, ShapeError
from memattn.kernels import kernels_supported
from memattn.ops.contract import BACKENDS, OP_BACKENDS, public_op

B, T, H, K, V, M = 2, 5, 3, 4, 6, 2


def inputs(name: str, dtype=torch.float32) -> tuple[tuple, dict]:
    """What `name` takes: positional tensors (q, k, v and its own) and keyword options."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    qkv = (rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V))
    return {
        "abc_attention": (qkv + (rand(B, T, H, M),), {}),
        "bounded_memory_attention": (qkv + (rand(B, T, H, M).abs(),), {}),
        "gated_slot_attention": (qkv + (-rand(B, T, H, M).abs(),), {}),
        "gmat_attention": (qkv, {"num_memory": 1, "causal": True, "chunk_size": 2}),
        "linear_attention": (qkv, {}),
        "local_window_attention": (qkv, {"window": 3}),
        "persistent_attention": (qkv + (rand(H, 4, K), rand(H, 4, V)), {}),
        "softmax_attention": (qkv, {}),
    }[name]


STATELESS = {"gmat_attention"}  # its decoder passes the rows of the last blocks as k and v
RUNS = [(name, backend) for name, backends in OP_BACKENDS.items() for backend in ("auto", *backends)
        if backend != "triton" or kernels_supported(torch.empty(0))]


def test_the_table_lists_every_op_and_only_known_backends():
    assert set(OP_BACKENDS) == {name for name in ops.__all__ if name.endswith("_attention")}
    for name, backends in OP_BACKENDS.items():
        assert "torch" in backends and set(backends) <= set(BACKENDS) - {"auto"}, name
        inputs(name)  # every op of the table has inputs here


def test_an_op_declares_its_backends_where_it_is_defined():
    """public_op lists the op under its name and refuses what it does not have; a declaration
    of a backend that does not exist, or without the torch forms, is refused."""
    @public_op("torch")
    def toy_attention(q, *, backend="auto"):
        return q, backend

    try:
        assert OP_BACKENDS["toy_attention"] == ("torch",) and toy_attention.__name__ == "toy_attention"
        assert toy_attention(1) == (1, "auto") and toy_attention(1, backend="torch") == (1, "torch")
        with pytest.raises(ConfigError, match="^backend: no Triton kernel exists for toy_attention"):
            toy_attention(1, backend="triton")
    finally:
        del OP_BACKENDS["toy_attention"]
    for backends in [("triton",), ("torch", "cuda"), ("torch", "auto")]:
        with pytest.raises(ValueError, match="^public_op: expected 'torch'"):
            public_op(*backends)


def check_state(state) -> None:
    assert isinstance(state, tuple) and hasattr(state, "_fields"), type(state)
    for field, t in zip(state._fields, state):
        if isinstance(t, torch.Tensor):
            assert t.shape[:2] == (B, H), (field, tuple(t.shape))


@pytest.mark.parametrize("name, backend", RUNS, ids=[f"{n}-{b}" for n, b in RUNS])
def test_every_op_returns_o_and_a_state_in_heads_first_layout(name, backend):
    op = getattr(ops, name)
    args, kw = inputs(name)
    o, state = op(*args, **kw, backend=backend)
    assert o.shape == (B, T, H, V) and o.dtype == args[0].dtype and state is None
    if name in STATELESS:
        with pytest.raises(ConfigError, match="^output_final_state:"):
            op(*args, **kw, backend=backend, output_final_state=True)
        return
    first = tuple(t[:, :3] if t.dim() == 4 else t for t in args)  # the persistent vectors stay
    rest = tuple(t[:, 3:] if t.dim() == 4 else t for t in args)
    _, state = op(*first, **kw, backend=backend, output_final_state=True)
    check_state(state)
    o_rest, end = op(*rest, **kw, backend=backend, initial_state=state, output_final_state=True)
    check_state(end)
    assert type(end) is type(state)
    torch.testing.assert_close(o_rest, o[:, 3:], rtol=1e-4, atol=1e-4)  # the state carries on
    with pytest.raises(ShapeError, match="^initial_state"):
        op(*rest, **kw, backend=backend, initial_state=torch.zeros(B, H, K, V))


@pytest.mark.parametrize("name", list(OP_BACKENDS))
def test_backends_an_op_does_not_have_are_refused(name):
    op = getattr(ops, name)
    args, kw = inputs(name)
    with pytest.raises(ConfigError, match=r"^backend: expected one of auto, torch, triton, got 'cuda'"):
        op(*args, **kw, backend="cuda")
    if "triton" not in OP_BACKENDS[name]:
        with pytest.raises(ConfigError, match=rf"^backend: no Triton kernel exists for {name}"):
            op(*args, **kw, backend="triton")


@pytest.mark.parametrize("name", list(OP_BACKENDS))
def test_a_wrong_dtype_or_shape_is_a_shape_error_naming_the_argument(name):
    op = getattr(ops, name)
    args, kw = inputs(name)
    with pytest.raises(ShapeError, match="^q: expected a floating point tensor"):
        op(args[0].long(), *args[1:], **kw)
    with pytest.raises(ShapeError, match="^v: expected the dtype of q"):
        op(*args[:2], args[2].double(), *args[3:], **kw)
    with pytest.raises(ShapeError, match=r"^k: expected \[B, T\w?, H\w?, K\] with dim 3 = 4"):
        op(args[0], args[1][..., :-1], *args[2:], **kw)
