"""Triton kernels for the memory ops, and when they can run.

    abc_chunk    chunked causal ABC_MLP, forward and backward, initial / final state,
                 packed variable-length batches (`abc_chunk_triton`)
    abc_decode   one fused ABC decoding step (`abc_step_triton`), also gated slot
                 attention's (`gsa_step_triton`)
    gsa_chunk    chunked causal gated slot attention through abc_chunk's kernels (RESET),
                 forward and backward, states, packed batches (`gsa_chunk_triton`)
    linear       chunked gated linear attention, forward and backward

The kernel modules import triton at the top; import them lazily, after checking
`triton_available()` or `kernels_supported(...)`. This module imports without triton.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, read when a kernel
is defined; tests/conftest.py sets it when no GPU is present). Where the interpreter differs
from compiled Triton, the kernels are written for both:

- `tl.dot` on bf16 operands gives wrong results: operands are upcast to fp32 first (where
  compiled code multiplies half operands, the interpreter multiplies the rounded values in
  fp32). Its fp32 -> bf16 conversion truncates, where compiled code rounds to nearest.
- The variable of a `range` loop is a Python int, with no `.to()`; offsets built from it
  are cast through a tensor they join.
- A scalar loaded from memory, or a scalar kernel argument, is a one-element array, not a
  0-d one, so it cannot bound a `range` (numpy refuses `__index__`): loops whose count is
  read from memory or passed at run time (the chunks of one sequence of a packed batch,
  the chunks of a sequence) are `while` loops, and sizes that bound a `range` are
  compile-time constants.
- A comparison may carry an integer dtype rather than a boolean one: masks go through
  `tl.where` or are combined with `&` of comparisons, never used as numbers.
- The interpreter runs a kernel as Python, so it accepts what compiled Triton refuses, e.g.
  one name bound to values of two types inside a `while` loop (compiled, every name bound
  in a loop is loop-carried and keeps its type; `_` counts). Compiling the kernels for a
  GPU target (triton.compile on an ASTSource, no GPU needed) catches these on the CPU.
- A masked load's `other` takes the tensor's dtype: a -1e30 sentinel is -inf in fp16
  (compiled too). Sentinels are set after the upcast, with `tl.where`.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from memattn.errors import ConfigError


def triton_available() -> bool:
    """True when the triton package is importable."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in its interpreter (TRITON_INTERPRET=1), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_supported(*tensors: torch.Tensor | None) -> bool:
    """True when triton is importable and every given tensor is on CUDA, or on the CPU
    under Triton's interpreter. None entries are skipped."""
    if not triton_available():
        return False
    cpu_ok = interpreting()
    return all(t.is_cuda or (cpu_ok and t.device.type == "cpu")
               for t in tensors if t is not None)


# Software-pipelining stages of the linear-attention kernels' scans over chunks (abc_chunk
# has its own, STATE_STAGES). 0: a `while` loop, which Triton does not pipeline: each chunk
# waits for its loads. N > 0: a `for` loop pipelined with N stages, which the interpreter
# cannot run (a loaded or run-time count cannot bound its `range`). 0 until the `for` form
# is timed on a GPU for these scans (benchmarks/gpu_kernels.py --scan-stages).
SCAN_STAGES = 0


def scan_stages(stages: int | None = None) -> int:
    """The STAGES a scan kernel is launched with: `stages` (SCAN_STAGES if None), 0 under the
    interpreter."""
    return 0 if interpreting() else SCAN_STAGES if stages is None else stages


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_kernels(backend: str, tensors, *, differentiable: bool = True) -> bool:
    """Whether an op takes its Triton kernel, for the op's `backend` argument (one of
    memattn.ops.contract.BACKENDS; ConfigError otherwise).

    "torch": never. "triton": always (triton must be installed; on CPU tensors the kernels
    run only under the interpreter). "auto": when every given tensor (None skipped) is a
    CUDA tensor in fp32 / fp16 / bf16 and triton can run it, never on the CPU, so nothing
    changes where there is no GPU; with differentiable=False (a kernel without a backward)
    also only when no tensor needs a gradient.
    """
    from memattn.ops.contract import BACKENDS  # memattn.ops imports this module

    if backend not in BACKENDS:
        raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "triton":
        if not triton_available():
            raise ConfigError("backend: 'triton' needs the triton package; use backend='torch'")
        return True
    given = [t for t in tensors if t is not None]
    if backend == "torch" or not all(isinstance(t, torch.Tensor) and t.is_cuda
                                     and t.dtype in KERNEL_DTYPES for t in given):
        return False
    if not differentiable and torch.is_grad_enabled() and any(t.requires_grad for t in given):
        return False
    return kernels_supported(*given)


__all__ = ["KERNEL_DTYPES", "SCAN_STAGES", "interpreting", "kernels_supported",
           "scan_stages", "triton_available", "use_kernels"]
