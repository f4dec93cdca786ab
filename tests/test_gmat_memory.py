"""GMAT never holds an L×L matrix: the peak memory of one `gmat` layer (forward and
backward) doubles, not quadruples, from L = 8,192 to L = 16,384.

Memory is measured by the PyTorch profiler's allocation events: the running sum of the
bytes allocated and freed inside the measured call (its peak), and its largest single
allocation. The dense reference, which builds the (M+L)×(M+L) mask and scores, shows
what quadratic growth looks like under the same instrument.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from memattn.layers import LayerSpec, build_attention
from memattn.ops.gmat import gmat_attention_reference


def memory_profile(fn) -> tuple[int, int]:
    """(peak bytes live, largest single allocation) of the CPU allocations made inside fn()."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert events, "the profiler recorded no allocations"
    live = peak = largest = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()  # frees are negative
        peak, largest = max(peak, live), max(largest, e.nbytes())
    return peak, largest


def layer_forward_backward(pattern: str, L: int, M: int = 8):
    spec = LayerSpec(d_model=32, n_heads=2, causal=False, positions="none")
    layer = build_attention("gmat", {"num_memory": M, "pattern": pattern, "chunk_size": 64,
                                     "window": 32, "n_buckets": 8}, spec)
    x = torch.randn(1, M + L, 32, requires_grad=True)

    def run():
        y, _ = layer(x)
        y.square().sum().backward()

    return run


@pytest.mark.parametrize("pattern", ["chunked", "window", "lsh"])
def test_peak_memory_of_one_layer_grows_linearly_in_length(pattern):
    memory_profile(layer_forward_backward(pattern, 256))  # warm-up: one-off allocations
    short_peak, short_largest = memory_profile(layer_forward_backward(pattern, 8192))
    long_peak, long_largest = memory_profile(layer_forward_backward(pattern, 16384))
    assert 1.8 < long_peak / short_peak < 2.2, (short_peak, long_peak)
    assert 1.8 < long_largest / short_largest < 2.2, (short_largest, long_largest)
    # one 16,384² fp32 matrix would be 1 GiB; the whole layer stays far below even one row block of it
    assert long_peak < 100 * 2**20


def test_the_instrument_sees_the_quadratic_dense_reference():
    def reference(L, M=8):
        q, k, v = (torch.randn(1, M + L, 2, 16, requires_grad=True) for _ in range(3))
        return lambda: gmat_attention_reference(q, k, v, num_memory=M, causal=False,
                                                chunk_size=64).sum().backward()

    short_peak, _ = memory_profile(reference(512))
    long_peak, _ = memory_profile(reference(1024))
    assert long_peak / short_peak > 3.5
