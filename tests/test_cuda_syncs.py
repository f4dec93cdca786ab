"""On a GPU no registered causal mechanism makes the host wait for the device: after one
warm-up (kernels compiled, layouts cached, caches grown once), a training step (forward
and backward) and decoding (a prompt, then single tokens) run under
`torch.cuda.set_sync_debug_mode("error")`, which turns every synchronising call (`.item()`,
`bool(tensor)`, a copy to the host, a blocking copy from it) into an error. A wait stalls
the queue of launches, which is what small models on a GPU are bound by.

Skipped without a GPU (the CPU never waits); the GPU session runs it with the suite. On
every machine the same run on the meta device (shapes, no data: reading a value to the host
is an error there) finds the host reads outside the GPU kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memattn.config import AttentionConfig, ModelConfig
from memattn.layers import mechanisms
from memattn.models import CausalLM

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Every causal mechanism with its defaults, and persistent with relative positions. The
# documented exception: an adaptive span is read to the host once per call to size the band
# it reads (memattn/ops/persistent/sdpa.py).
CASES = [(name, {}) for name, m in mechanisms().items() if m.causal]
CASES.append(("persistent", {"relative_positions": True}))


# Off the GPU the ABC ops with learned write weights take their torch form, which checks
# the data for chunks to compute again exactly (memattn/ops/abc/chunked.py); on a GPU the
# kernels do not.
TORCH_FORM_READS = {"abc-mlp", "abc-cluster"}


def step_and_decode(name, options, device):
    """A training step and decoding (a prompt, then single tokens) of a small LM, as a call."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=31, d_model=64, n_layers=2, n_heads=4, ff_mult=2, max_len=128,
                      attention=AttentionConfig(name, options))
    model = CausalLM(cfg).to(device)
    idx = torch.randint(0, 31, (2, 64), device=device)

    def run():
        logits = model(idx)
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        with torch.no_grad():
            cache = model.init_cache(2, device=device)
            model(idx[:, :32], cache=cache)
            for t in range(32, 40):
                model(idx[:, t:t + 1], cache=cache)

    return run


@pytest.mark.parametrize("name, options", [c for c in CASES if c[0] not in TORCH_FORM_READS])
def test_no_value_is_read_to_the_host_on_the_meta_device(name, options):
    step_and_decode(name, options, "meta")()


@needs_gpu
@pytest.mark.parametrize("name, options", CASES)
def test_a_training_step_and_decoding_never_wait_for_the_gpu(name, options):
    run = step_and_decode(name, options, "cuda")
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
