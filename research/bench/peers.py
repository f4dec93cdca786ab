"""Peer libraries measured beside memattn where installed, each against the memattn mechanism
it computes (or the nearest one), at the same shapes and in the same run:

    mechanism    peer                                                  compared as
    abc-mlp      flash-linear-attention `chunk_abc` (CUDA, Triton)    the op (train)
                 flash-linear-attention `naive_recurrent_abc`         the op (train)
                 (its pure-PyTorch reference, any device)
    gsa          flash-linear-attention `chunk_gsa` (CUDA, Triton)    the op (benchmarks/
                                                                       gpu_kernels.py)
    persistent   x-transformers `Attention(num_mem_kv=N)`             layer, LM (train, decode)
    gmat         x-transformers `TransformerWrapper(num_memory_tokens=M,
                 memory_tokens_interspersed_every=C)`                 LM (train, decode)
    abc-window   local-attention `LocalMHA` (`LocalAttention(window_size=n-1, look_backward=1,
                 exact_windowsize=True, autopad=True, causal=True)`)  layer, LM (train, decode)
    linear       pytorch-fast-transformers `CausalLinearAttention`
                 (`causal_dot_product`), `RecurrentLinearAttention`   layer, LM (train, decode)

A peer layer is wrapped in memattn's layer interface (`y, state = layer(x, memory_state=...)`,
`init_state`), so that its LM rows are memattn's LM with each attention layer replaced by
the peer's (same embeddings, norms and feed-forward) and its decoding runs through the
peer's own cache. The wrappers hold no attention code of their own: they call the peer and
keep what it returns. Peer layers have no rotary positions (none of these modules has them
standalone; the memattn LM rotates q and k), so a peer's LM row does slightly less work.

Every import is guarded: a missing peer, a device it does not support, or options of the
memattn mechanism it does not compute give a reason that the results record as a skipped
row (`PeerUnavailable`).
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from memattn.errors import ConfigError
from memattn.layers.base import AttentionState, LayerSpec

FLA_ABC = "chunk_abc (fla)"
FLA_NAIVE_ABC = "naive_recurrent_abc (fla, peer)"


class PeerUnavailable(Exception):
    """A peer that cannot be measured here; str(e) says why (recorded as the skipped row's reason)."""


def fla_chunk_abc(device: torch.device) -> tuple[Callable | None, str]:
    """(op(q, k, v, s) -> o [B, T, H, V] for q, k, v [B, T, H, D], s [B, T, H, M], "") where
    flash-linear-attention is installed and runs on `device`; else (None, the reason)."""
    if device.type != "cuda":
        return None, (f"flash-linear-attention's `fla.ops.abc.chunk_abc` is a Triton kernel for "
                      f"CUDA; this run is on {device.type}")
    try:
        from fla.ops.abc import chunk_abc
    except Exception as e:  # noqa: BLE001  (ImportError, or a failing import inside fla)
        return None, f"flash-linear-attention is not installed (`import fla.ops.abc` failed: {e})"
    kwargs = {"head_first": False} if "head_first" in inspect.signature(chunk_abc).parameters else {}

    def op(q, k, v, s):
        return chunk_abc(q, k, v, s, **kwargs)[0]

    return op, ""


def fla_chunk_gsa(device: torch.device) -> tuple[Callable | None, str]:
    """(op(q, k, v, g) -> o [B, T, H, V] for q, k, v [B, T, H, D] and log forget gates g
    [B, T, H, M], "") where flash-linear-attention is installed and runs on `device`; else
    (None, the reason). The op is `fla.ops.gsa.chunk_gsa` with the write weights its GSA
    layer gives it, s = 1 - exp(g) (memattn's gsa: K̃_t = α_t K̃_{t-1} + (1 - α_t) k_t)."""
    if device.type != "cuda":
        return None, (f"flash-linear-attention's `fla.ops.gsa.chunk_gsa` is a Triton kernel for "
                      f"CUDA; this run is on {device.type}")
    try:
        from fla.ops.gsa import chunk_gsa
    except Exception as e:  # noqa: BLE001  (ImportError, or a failing import inside fla)
        return None, f"flash-linear-attention is not installed (`import fla.ops.gsa` failed: {e})"

    def op(q, k, v, g):
        return chunk_gsa(q, k, v, (1 - g.float().exp()).to(g.dtype), g)[0]

    return op, ""


def _fla_naive_module():
    """fla/ops/abc/naive.py as a module. Importing `fla.ops.abc` runs its Triton kernels'
    files (`import triton`), so without Triton the file, which needs only torch and einops,
    is loaded by its path."""
    try:
        import fla
    except Exception as e:  # noqa: BLE001
        raise PeerUnavailable(f"flash-linear-attention is not installed (`import fla` failed: {e})") from e
    try:
        from fla.ops.abc import naive
        return naive
    except Exception:  # noqa: BLE001  (no triton: load the pure-PyTorch file by its path)
        path = Path(fla.__file__).parent / "ops" / "abc" / "naive.py"
        try:
            spec = importlib.util.spec_from_file_location("memattn_peer_fla_abc_naive", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001
            raise PeerUnavailable(f"flash-linear-attention {getattr(fla, '__version__', '?')}: "
                                  f"{path} could not be loaded ({e})") from e
        return module


def fla_naive_abc(device: torch.device) -> tuple[Callable | None, str]:
    """(op(q, k, v, s) -> o [B, T, H, V], "") with flash-linear-attention's pure-PyTorch
    `naive_recurrent_abc` (a loop over T, fp32 inside; head-first [B, H, T, D], so the op
    transposes in and out), or (None, the reason)."""
    try:
        naive = _fla_naive_module().naive_recurrent_abc
    except PeerUnavailable as e:
        return None, str(e)
    except AttributeError as e:
        return None, f"flash-linear-attention has no `naive_recurrent_abc` ({e})"

    def op(q, k, v, s):
        o, _ = naive(*(t.transpose(1, 2) for t in (q, k, v, s)))
        return o.transpose(1, 2)

    return op, ""


# Decoding state of a peer layer -----------------------------------------------------------


class PeerState(AttentionState):
    """What a peer layer keeps between decoding calls, as the peer returned it (`held`),
    read by `nbytes`: its tensors are `tensors_of(held)` (default: held itself, a tensor or
    nested tuples of tensors). fixed_size: whether the peer bounds it."""

    def __init__(self, fixed_size: bool, tensors_of: Callable | None = None) -> None:
        self._fixed = fixed_size
        self._tensors_of = tensors_of or (lambda held: held)
        self.held = None
        self.seen = 0

    @property
    def fixed_size(self) -> bool:  # type: ignore[override]
        return self._fixed

    def tensors(self) -> list[torch.Tensor]:
        def flat(x):
            if isinstance(x, torch.Tensor):
                return [x]
            if isinstance(x, (tuple, list)):
                return [t for item in x for t in flat(item)]
            return []

        return [] if self.held is None else flat(self._tensors_of(self.held))


def _no_mask(attention_mask: torch.Tensor | None, what: str) -> None:
    if attention_mask is not None:
        raise ConfigError(f"attention_mask: the {what} peer is measured on unpadded rows; got a mask")


def _import(module: str, library: str):
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (ImportError, or a failing import inside the peer)
        raise PeerUnavailable(f"{library} is not installed (`import {module}` failed: {e})") from e


def _causal(spec: LayerSpec, library: str) -> None:
    if not spec.causal:
        raise PeerUnavailable(f"{library}: only the causal form is measured")


# x-transformers: persistent memory key/values ---------------------------------------------


class XTransformersPersistent(nn.Module):
    """x-transformers `Attention(num_mem_kv=N, flash=True)` (its SDPA path): N learned key /
    value vectors per head in front of the keys, one joint softmax: memattn's `persistent`
    all-attn variant. Decoding: its KV cache (`cache=`, `return_intermediates=True`), which
    keeps every past key and value (the memory vectors are parameters, never cached)."""

    def __init__(self, spec: LayerSpec, n: int) -> None:
        super().__init__()
        xt = _import("x_transformers", "x-transformers")
        _causal(spec, "x-transformers")
        self.spec = spec
        self.attn = xt.Attention(dim=spec.d_model, heads=spec.n_heads, dim_head=spec.head_dim,
                                 causal=True, num_mem_kv=n, flash=True)

    def init_state(self, batch_size: int, device=None, dtype=None) -> PeerState:
        return PeerState(fixed_size=False, tensors_of=lambda inter: inter.cached_kv)

    def forward(self, x, *, memory_state: PeerState | None = None, attention_mask=None, positions=None):
        """x [B, T, d] -> (y [B, T, d], memory_state); the state holds its Intermediates
        (cached_kv: k, v [B, H, T_seen, D])."""
        _no_mask(attention_mask, "x-transformers")
        if memory_state is None:
            return self.attn(x), None
        y, inter = self.attn(x, cache=memory_state.held, return_intermediates=True)
        memory_state.held, memory_state.seen = inter, memory_state.seen + x.shape[1]
        return y, memory_state


def _persistent_peer(spec: LayerSpec, options: dict) -> nn.Module:
    from memattn.layers.persistent import PersistentOptions

    o = PersistentOptions(**options)
    other = {"variant": (o.variant, "all-attn"), "context": (o.context, "softmax"),
             "relative_positions": (o.relative_positions, False), "adaptive_span": (o.adaptive_span, False)}
    differ = [f"{k}={v!r}" for k, (v, want) in other.items() if v != want]
    if differ or o.n_persistent < 1:
        raise PeerUnavailable("x-transformers' num_mem_kv is the all-attn variant over the whole "
                              f"context with N >= 1 vectors; this persistent has {', '.join(differ) or 'N = 0'}")
    return XTransformersPersistent(spec, o.n_persistent)


# x-transformers: memory tokens (against gmat) ---------------------------------------------

XT_MEMORY_CACHE = ("x-transformers turns its KV cache off with memory tokens "
                   "(`self.can_cache_kv = self.num_memory_tokens == 0 and not recycling and "
                   "self.attn_layers.can_cache_kv`, x_transformers.py:4192 in 2.31.10, which "
                   "`generate` obeys), so each decoding step runs the whole prefix again; "
                   "its state is the token ids")


class PrefixCache:
    """The decoding 'state' of a model without a cache: the token ids read so far [B, T]."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.position = 0

    def nbytes(self) -> int:
        return 0 if self.ids is None else self.ids.numel() * self.ids.element_size()

    @property
    def fixed_size(self) -> bool:
        return False


class XTransformersMemoryLM(nn.Module):
    """x-transformers `TransformerWrapper(num_memory_tokens=M, memory_tokens_interspersed_every=C)`
    over a `Decoder` of memattn's LM shape (pre-norm, feed-forward ff_mult·d, rotary over the
    whole head when the LM has rotary positions, tied embeddings, SDPA): a fresh block of M learned tokens before every chunk
    of C tokens, as memattn's causal gmat places them, but read by full causal attention
    (gmat: each chunk reads only the block before it). idx [B, T] -> logits [B, T, vocab]."""

    def __init__(self, shape, num_memory: int, chunk: int) -> None:
        super().__init__()
        xt = _import("x_transformers", "x-transformers")
        D = shape.d_model // shape.n_heads
        decoder = xt.Decoder(dim=shape.d_model, depth=shape.n_layers, heads=shape.n_heads,
                             attn_dim_head=D, rotary_pos_emb=shape.positions == "rotary", rotary_emb_dim=D,
                             attn_flash=True, ff_mult=shape.ff_mult)
        self.net = xt.TransformerWrapper(num_tokens=shape.vocab_size, max_seq_len=0,
                                         num_memory_tokens=num_memory,
                                         memory_tokens_interspersed_every=chunk,
                                         use_abs_pos_emb=False, tie_embedding=True,
                                         attn_layers=decoder)

    def init_cache(self, batch_size: int, device=None, dtype=None) -> PrefixCache:
        return PrefixCache()

    def forward(self, idx: torch.Tensor, *, cache: PrefixCache | None = None) -> torch.Tensor:
        if cache is None:
            return self.net(idx)
        cache.ids = idx if cache.ids is None else torch.cat([cache.ids, idx], 1)
        cache.position = cache.ids.shape[1]
        return self.net(cache.ids)[:, -idx.shape[1]:]


def _gmat_peer_lm(shape, options: dict) -> nn.Module:
    from memattn.layers.gmat import GmatOptions

    o = GmatOptions(**options)
    if o.num_memory < 1:
        raise PeerUnavailable("x-transformers memory tokens: this gmat has num_memory=0")
    return XTransformersMemoryLM(shape, o.num_memory, o.chunk_size)


def _gmat_no_layer(spec: LayerSpec, options: dict) -> nn.Module:
    raise PeerUnavailable("x-transformers places memory tokens in its model (TransformerWrapper), "
                          "not in an attention layer: compared in the LM rows only")


# local-attention: sliding window (against abc-window) -------------------------------------


class LocalAttentionWindow(nn.Module):
    """local-attention `LocalMHA(window_size=n-1, look_backward=1, exact_windowsize=True,
    causal=True, use_rotary_pos_emb=False)`: query t reads keys t-n+1 .. t, memattn's causal
    abc-window with n slots. Rotary is off: with it on, LocalMHA 1.11.2's cached path rotates
    the cached (already rotated) keys again. Decoding: LocalMHA's cache, one token a call,
    holding the last n keys and values ([2, B, H, n, D]); a longer input after the first is
    fed to it token by token."""

    def __init__(self, spec: LayerSpec, n: int) -> None:
        super().__init__()
        la = _import("local_attention", "local-attention")
        _causal(spec, "local-attention")
        if n < 2:
            raise PeerUnavailable(f"local-attention needs window_size = n - 1 >= 1; this abc-window has n = {n}")
        self.n = n
        self.attn = la.LocalMHA(dim=spec.d_model, window_size=n - 1, dim_head=spec.head_dim,
                                heads=spec.n_heads, causal=True, look_backward=1,
                                exact_windowsize=True, use_rotary_pos_emb=False)

    def init_state(self, batch_size: int, device=None, dtype=None) -> PeerState:
        return PeerState(fixed_size=True)

    def forward(self, x, *, memory_state: PeerState | None = None, attention_mask=None, positions=None):
        _no_mask(attention_mask, "local-attention")
        if memory_state is None:
            return self.attn(x), None
        T = x.shape[1]
        if memory_state.held is None:
            y, kv = self.attn(x, return_cache=True)
            kv = kv[..., -self.n:, :]  # what its next cached step keeps of them anyway
        else:
            ys, kv = [], memory_state.held
            for t in range(T):
                y, kv = self.attn(x[:, t:t + 1], cache=kv, return_cache=True)
                ys.append(y)
            y = torch.cat(ys, 1) if T > 1 else ys[0]
        memory_state.held, memory_state.seen = kv, memory_state.seen + T
        return y, memory_state


def _window_peer(spec: LayerSpec, options: dict) -> nn.Module:
    from memattn.layers.abc.window import ABCWindowOptions

    return LocalAttentionWindow(spec, ABCWindowOptions(**options).window)


# pytorch-fast-transformers: linear attention ----------------------------------------------


class FastTransformersLinear(nn.Module):
    """pytorch-fast-transformers `AttentionLayer(CausalLinearAttention)` (its C++
    `causal_dot_product`, elu+1 features, normalised) for whole sequences, and
    `RecurrentAttentionLayer(RecurrentLinearAttention)` sharing its projections for
    decoding: memattn's `linear` at its defaults. State: S [B, H, D, D] and Z [B, H, D]."""

    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        attention = _import("fast_transformers.attention", "pytorch-fast-transformers")
        recurrent = _import("fast_transformers.recurrent.attention", "pytorch-fast-transformers")
        self.masking = _import("fast_transformers.masking", "pytorch-fast-transformers")
        _causal(spec, "pytorch-fast-transformers")
        D = spec.head_dim
        self.full = attention.AttentionLayer(attention.CausalLinearAttention(D), spec.d_model, spec.n_heads)
        step = recurrent.RecurrentAttentionLayer(recurrent.RecurrentLinearAttention(D), spec.d_model, spec.n_heads)
        for name in ("query_projection", "key_projection", "value_projection", "out_projection"):
            setattr(step, name, getattr(self.full, name))
        self.step = [step]  # not a submodule: its parameters are the full layer's

    def init_state(self, batch_size: int, device=None, dtype=None) -> PeerState:
        return PeerState(fixed_size=True)

    def forward(self, x, *, memory_state: PeerState | None = None, attention_mask=None, positions=None):
        _no_mask(attention_mask, "pytorch-fast-transformers")
        B, T, _ = x.shape
        if memory_state is None:
            m = self.masking
            lengths = m.LengthMask(torch.full((B,), T, dtype=torch.long, device=x.device), max_len=T)
            return self.full(x, x, x, m.TriangularCausalMask(T, device=x.device), lengths, lengths), None
        ys, state = [], memory_state.held
        for t in range(T):
            y, state = self.step[0](x[:, t], x[:, t], x[:, t], state=state)
            ys.append(y)
        memory_state.held, memory_state.seen = state, memory_state.seen + T
        return torch.stack(ys, 1), memory_state


def _linear_peer(spec: LayerSpec, options: dict) -> nn.Module:
    from memattn.layers.linear import LinearOptions

    o = LinearOptions(**options)
    if (o.feature_map, o.normalize) != ("elu+1", True):
        raise PeerUnavailable("pytorch-fast-transformers' linear attention is elu+1 features, "
                              f"normalised; this linear has feature_map={o.feature_map}, normalize={o.normalize}")
    return FastTransformersLinear(spec)


# The peers of each mechanism ---------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """A peer library's counterpart of one memattn mechanism.

    layer(spec, options) -> a module with memattn's layer interface; lm(shape, options) ->
    a whole causal LM (idx [B, T] -> logits, `init_cache`), for a peer whose mechanism
    lives in its model. Both raise PeerUnavailable with the reason it cannot be measured.
    """

    name: str  # the row label is "<name> (peer)"
    mechanism: str
    layer: Callable[[LayerSpec, dict], nn.Module]
    lm: Callable | None = None
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} (peer)"


PEERS: tuple[Peer, ...] = (
    Peer("x-transformers num_mem_kv", "persistent", _persistent_peer),
    Peer("x-transformers memory tokens", "gmat", _gmat_no_layer, lm=_gmat_peer_lm, note=XT_MEMORY_CACHE),
    Peer("local-attention LocalMHA", "abc-window", _window_peer),
    Peer("fast-transformers linear", "linear", _linear_peer),
)


def peers_of(mechanism: str) -> list[Peer]:
    """The peers measured against `mechanism` (a registry name)."""
    return [p for p in PEERS if p.mechanism == mechanism]


def peer_lm(peer: Peer, lm_shape, options: dict, model: nn.Module) -> nn.Module:
    """The LM a peer row measures: peer.lm's own model, else `model` (memattn's LM built for
    the compared mechanism) with every block's attention replaced by the peer layer."""
    if peer.lm is not None:
        return peer.lm(lm_shape, options)
    layers = [peer.layer(block.attn.spec, options) for block in model.blocks]
    if lm_shape.positions != "none":
        raise PeerUnavailable(f"the peer's layers apply no positions while this LM rotates q and k in "
                              f"every layer (lm.positions={lm_shape.positions}); run with lm.positions=none "
                              "for a like-for-like comparison")
    for block, layer in zip(model.blocks, layers):
        block.attn = layer
    return model


def peer_reason(e: Exception) -> str:
    """The skipped row's reason for a peer that failed to build."""
    return str(e) if isinstance(e, PeerUnavailable) else f"{type(e).__name__}: {e}"
