"""memattn.generate: the compiled decoding step gives the eager step's tokens."""

import pytest
import torch

from memattn.config import AttentionConfig, ModelConfig
from memattn.generate import generate
from memattn.models import CausalLM


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [("abc-mlp", {"num_slots": 4}), ("gsa", {"num_slots": 4}), ("linear", {}),
                                          ("softmax", {})])
def test_compiled_decoding_gives_the_eager_tokens(name, options):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, init_std=0.3,
                                 attention=AttentionConfig(name, options)))
    prompt = torch.randint(0, 40, (2, 9))
    eager = torch.stack(list(generate(model, prompt, 12, temperature=0)), 1)
    compiled = torch.stack(list(generate(model, prompt, 12, temperature=0, compile=True)), 1)
    assert torch.equal(eager, compiled)
    sampled = [torch.stack(list(generate(model, prompt, 12, temperature=1.0, seed=3, compile=c)), 1)
               for c in (False, True)]
    assert torch.equal(*sampled)
    assert len(set(sampled[0].flatten().tolist())) > 3  # a sequence that can tell two steps apart


@pytest.mark.slow
def test_a_compiled_step_refuses_a_token_outside_the_vocabulary():
    """The compiled step reads nothing back; its check of the ids is a device-side assertion."""
    from memattn.generate import decoding_step

    torch._dynamo.reset()  # the models other tests compiled count towards a recompile limit, past which it runs eager
    model = CausalLM(ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2))
    step, cache = decoding_step(model), model.init_cache(1)
    with torch.inference_mode():
        step(torch.tensor([[3]]), cache=cache)
        with pytest.raises(RuntimeError, match=r"token ids must lie in \[0, 40\)"):
            step(torch.tensor([[40]]), cache=cache)
