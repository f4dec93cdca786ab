"""On a GPU no registered causal mechanism makes the host wait for the device: after one
warm-up (kernels compiled, layouts cached, caches grown once), a training step (forward
and backward) and decoding (a prompt, then single tokens) run under
`torch.cuda.set_sync_debug_mode("error")`, which turns every synchronising call (`.item()`,
`bool(tensor)`, a copy to the host, a blocking copy from it) into an error. A wait stalls
the queue of launches, which is what small models on a GPU are bound by.

Skipped without a GPU (the CPU never waits); the GPU session runs it with the suite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memattn.config import AttentionConfig, ModelConfig
from memattn.layers import mechanisms
from memattn.models import CausalLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Every causal mechanism with its defaults, and persistent with relative positions. The
# documented exception: an adaptive span is read to the host once per call to size the band
# it reads (memattn/ops/persistent/sdpa.py).
CASES = [(name, {}) for name, m in mechanisms().items() if m.causal]
CASES.append(("persistent", {"relative_positions": True}))


@pytest.mark.parametrize("name, options", CASES)
def test_a_training_step_and_decoding_never_wait_for_the_gpu(name, options):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=31, d_model=64, n_layers=2, n_heads=4, ff_mult=2, max_len=128,
                      attention=AttentionConfig(name, options))
    model = CausalLM(cfg).cuda()
    idx = torch.randint(0, 31, (2, 64), device="cuda")

    def run():
        logits = model(idx)
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        with torch.no_grad():
            cache = model.init_cache(2, device="cuda")
            model(idx[:, :32], cache=cache)
            for t in range(32, 40):
                model(idx[:, t:t + 1], cache=cache)

    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
