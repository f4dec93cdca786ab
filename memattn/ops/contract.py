"""The contract every op keeps, in one place: its signature, its state, its backends, and the
scale, dtype and input rules the ops share.

    op(q, k, v, ..., causal, scale=None, initial_state=None, output_final_state=False,
       backend="auto") -> (o, state)

o [B, Tq, H, V] comes back in q's dtype. state is None unless output_final_state; then it
is the op's NamedTuple of tensors laid out [B, H, ...] (ABCState, KVState, ...), which
initial_state takes back: running x[:a], then x[a:] from its state, equals running x whole.
`mode`, where an op has one, picks a computational form (reference, chunked, recurrent) and
never changes the answer. Errors are ShapeError (a tensor's rank, size, dtype, device or
values) and ConfigError (an option), each naming the argument at fault.

`backend` picks the code that runs an op:

    auto     the Triton kernel where the op has one and the inputs are CUDA tensors it
             takes; the torch forms otherwise (always on the CPU)
    torch    the torch forms
    triton   the Triton kernel, on CPU tensors only under Triton's interpreter
             (TRITON_INTERPRET=1); a ConfigError for an op without one

An op declares its backends where it is defined, `@public_op("torch", ...)`, which lists it in
`OP_BACKENDS` (which backends exist for which op; "auto" is accepted by all) and refuses a
backend it does not have before it runs.
"""

from __future__ import annotations

import functools

import torch

from memattn.errors import ConfigError, ShapeError, check_devices, check_float, check_tensor

BACKENDS = ("auto", "torch", "triton")

OP_BACKENDS: dict[str, tuple[str, ...]] = {}  # op name -> its backends, each declared by `public_op`


def public_op(*backends: str):
    """Decorator of a public op that has `backends` (the torch forms and any others, not
    "auto"): lists it in OP_BACKENDS under its name, and checks its `backend` argument
    (`check_backend`) before it runs."""
    if "torch" not in backends or not set(backends) <= set(BACKENDS) - {"auto"}:
        raise ValueError(f"public_op: expected 'torch' and any of 'triton', got {backends}")

    def declare(op):
        if op.__name__ in OP_BACKENDS:
            raise ValueError(f"public_op: {op.__name__} is declared already")
        OP_BACKENDS[op.__name__] = tuple(backends)

        @functools.wraps(op)
        def run(*args, backend: str = "auto", **kwargs):
            check_backend(op.__name__, backend)
            return op(*args, backend=backend, **kwargs)

        return run

    return declare


def check_backend(op: str, backend: str) -> None:
    """ConfigError naming `backend` unless it is one that `op` has (or "auto")."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "auto" and backend not in OP_BACKENDS[op]:
        raise ConfigError(f"backend: no Triton kernel exists for {op}; use backend='auto' "
                          f"or 'torch'")


def default_scale(scale: float | None, k_dim: int) -> float:
    """The score scale of the softmax reads: K^-0.5 unless given."""
    return k_dim ** -0.5 if scale is None else float(scale)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; fp32, fp16 and bf16 accumulate in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The accumulation dtype of the widest input: float64 if any is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) \
        else torch.float32


def outside_autocast(op):
    """The op with autocast off while it runs: it casts its inputs to its compute dtype
    itself (`compute_dtype`), which autocast would undo in its matmuls, and mix dtypes where
    its parts meet."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return op(*args, **kwargs)

    return run


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, length: str = "T",
              heads: str = "H") -> tuple[int, int, int, int, int, int]:
    """Check q [B, Tq, H, K], k [B, T, H, K], v [B, T, H, V]: ranks, matching sizes, one
    floating-point dtype, q's device. Returns (B, Tq, T, H, K, V); ShapeError names the
    argument. `length` and `heads` name T and H in the messages; heads other than "H" (e.g.
    "Hc") lets k and v have their own number of heads, which is returned as H."""
    check_tensor("q", q, "[B, Tq, H, K]", None, None, None, None)
    B, Tq, H, K = q.shape
    check_tensor("k", k, f"[B, {length}, {heads}, K]", B, None, H if heads == "H" else None, K)
    T, H = k.shape[1], k.shape[2]
    check_tensor("v", v, f"[B, {length}, {heads}, V]", B, T, H, None)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ShapeError(f"{name}: expected the dtype of q ({q.dtype}), got {t.dtype}")
    check_devices(q, k=k, v=v)
    return B, Tq, T, H, K, v.shape[-1]


def check_mask(attention_mask: torch.Tensor | None, B: int, T: int, layout: str = "[B, T]") -> None:
    """ShapeError unless attention_mask is None or a bool tensor `layout` = [B, T]."""
    if attention_mask is None:
        return
    check_tensor("attention_mask", attention_mask, layout, B, T)
    if attention_mask.dtype != torch.bool:
        raise ShapeError(f"attention_mask: expected dtype torch.bool, got {attention_mask.dtype}")


def check_packed(cu_seqlens, causal: bool, mode: str) -> None:
    """ConfigError unless packed sequences (`cu_seqlens` not None) come with a causal call in
    the chunked form (mode "auto" or "chunked")."""
    if cu_seqlens is None:
        return
    if not causal:
        raise ConfigError("cu_seqlens: packed sequences are supported with causal=True "
                          "only; run each sequence on its own for causal=False")
    if mode not in ("auto", "chunked"):
        raise ConfigError(f"cu_seqlens: packed sequences take the chunked form, "
                          f"mode 'auto' or 'chunked', got mode={mode!r}")


def check_state_type(state, state_type: type, name: str = "initial_state") -> None:
    """ShapeError unless `state` is None or a `state_type` tuple of its fields' length."""
    fields = state_type._fields
    if state is not None and (not isinstance(state, tuple) or len(state) != len(fields)):
        raise ShapeError(f"{name}: expected a {state_type.__name__} "
                         f"({', '.join(fields)}), got {type(state).__name__}"
                         + (f" of length {len(state)}" if isinstance(state, tuple) else ""))


def check_no_state(op: str, initial_state, output_final_state: bool, why: str) -> None:
    """ConfigError naming the argument when a stateless op is given or asked for a state."""
    for name, given in (("initial_state", initial_state is not None),
                        ("output_final_state", bool(output_final_state))):
        if given:
            raise ConfigError(f"{name}: {op} keeps no state here ({why})")


def finite_or_off_cpu(*tensors) -> bool:
    """False when a CPU tensor among `tensors` (None and tuples allowed) holds a NaN or an
    infinity. The chunked forms mix every step of a chunk in one product, so a non-finite
    input there would spoil the outputs before it; the ops then take the step-by-step form,
    whose outputs before it are exact. Checked through one sum per tensor (NaN and infinity
    reach it; about 1 % of the op on the CPU; a sum that overflows only costs the faster form).
    Not checked on a GPU, where it would synchronise."""
    flat = [t for x in tensors for t in (x if isinstance(x, tuple) else (x,)) if t is not None]
    return all(t.device.type != "cpu" or not t.is_floating_point()
               or bool(torch.isfinite(t.sum(dtype=torch.float32 if t.element_size() < 4 else None)))
               for t in flat)
