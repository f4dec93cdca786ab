import os
import random

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the switch is
# read when a kernel is defined, so it is set before anything imports memattn.kernels.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Each test process uses one thread: `make test` runs two processes on two cores, and
    the many tiny ops of the references run faster without a second thread."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def text_file(tmp_path):
    """A small local corpus (no download): a few thousand characters of varied text."""
    rng = random.Random(0)
    words = ["the", "king", "queen", "doth", "speak", "thou", "art", "my", "lord", "good",
             "night", "sweet", "prince", "and", "to", "be", "or", "not", "what", "light"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + "."
             for _ in range(600)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def registered(capability=None):
    """The names of the registered mechanisms (those that declare `capability`, a field of
    memattn.layers.Mechanism such as "causal", when given): what the generic tests run over,
    each with its registration's `test_options`."""
    from memattn.layers import mechanisms

    return [name for name, m in mechanisms().items() if capability is None or getattr(m, capability)]


def tiny_overrides(text_file, root, *extra):
    """Overrides for a seconds-long run on `text_file`, writing under the folder `root`."""
    return ["data.corpus=text", f"data.path={text_file}", f"data.cache_dir={root / 'cache'}",
            f"train.out_dir={root / 'run'}", "train.threads=1", *extra]


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty / empty_like / Tensor.new_empty fill floating tensors with NaN, so a kernel
    that reads memory it did not write shows it."""
    def filled(make):
        def wrapper(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return wrapper

    for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
        monkeypatch.setattr(owner, name, filled(getattr(owner, name)))


def run_quick_lm_experiment(name, text_file, tmp_path, *extra):
    """`memattn experiment NAME --quick` on `text_file` through the CLI, with `extra` settings:
    (out dir, results.json)."""
    import json

    from memattn.cli import main

    out = tmp_path / "results"
    data = ["data.corpus=text", f"data.path={text_file}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(["experiment", name, *data, *extra, "--quick", "--out-dir", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


class Crash(Exception):
    """Raised from a training callback: the run stops as a killed process would."""


def train_crashing_at(cfg, step):
    """Train `cfg` and stop it with Crash right after `step` is logged."""
    from memattn.train import train

    def crash(at, record):
        if at == step:
            raise Crash

    with pytest.raises(Crash):
        train(cfg, progress=False, on_step=crash)


def crash_in_transfer_and_resume(cfg, transfer_step=None):
    """Train `cfg`, stop it with Crash at attention-transfer step `transfer_step` (None: at
    the first ordinary step), then resume it to the end."""
    from memattn.train import train

    def crash(step, record):
        if (record.get("transfer_step") == transfer_step if transfer_step is not None else step == 1):
            raise Crash

    with pytest.raises(Crash):
        train(cfg, progress=False, on_step=crash)
    train(cfg, resume=True, progress=False)


def outputs_and_grads(fn, xs, dtype, state_type, *, with_state=True, **kw):
    """o, final state and the gradients of a fixed random functional of both, taken through
    `fn(*xs[:4], initial_state=state_type(*xs[4:]), output_final_state=True, **kw)` on the
    inputs cast to `dtype` (the state stays in float32 / float64), all as float64."""
    leaves = [x.to(dtype).requires_grad_() for x in xs[:4]]
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    state = [x.to(state_dtype).requires_grad_() for x in xs[4:]] if with_state else []
    o, final = fn(*leaves, initial_state=state_type(*state) if with_state else None,
                  output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(123)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
    for t in final:
        loss = loss + (t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)).sum()
    grads = torch.autograd.grad(loss, leaves + state)
    return [t.detach().double() for t in (o, *final, *grads)]


def assert_named_close(got, want, names, **tol):
    """Each pair finite in `got` and close to `want`, a failure naming the tensor."""
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")


def assert_packed_is_each_sequence(want, reference, xs, bounds, state_type):
    """`want` (outputs_and_grads of a packed-sequence form over xs, sequences at `bounds`)
    holds, in its outputs and final states, one `reference` call per sequence, side by side."""
    import itertools

    per_seq = [reference(*(x[:, a:b] for x in xs[:4]), initial_state=state_type(*(t[n:n + 1] for t in xs[4:])),
                         output_final_state=True)
               for n, (a, b) in enumerate(itertools.pairwise(bounds))]
    torch.testing.assert_close(want[0], torch.cat([o for o, _ in per_seq], dim=1))
    for i in range(len(per_seq[0][1])):
        torch.testing.assert_close(want[1 + i], torch.cat([st[i] for _, st in per_seq]))


# Scores as lm-evaluation-harness computes them, from a model's logits (logits_of: ids [1, n] -> [1, n, vocab])

def logprobs(logits_of, context: list[int], targets: list[int]) -> float:
    """Σ log p(target | context, earlier targets): the last len(targets) positions of one pass."""
    ids = context + targets[:-1]
    logp = torch.log_softmax(logits_of(torch.tensor([ids])).float(), -1)[0, -len(targets):]
    return float(logp.gather(-1, torch.tensor(targets)[:, None]).double().sum())


def rolling(logits_of, ids: list[int], bos: int, L: int) -> float:
    """Σ log p of every token of a text, read in windows of at most L tokens: the first from bos,
    each later chunk of L predicted from the L tokens before its last (lm-eval's windows)."""
    total, start = 0.0, 0
    while start < len(ids):
        end = min(start + L, len(ids))
        context = [bos] + ids[:start] if start == 0 else ids[end - L - 1:start]
        total += logprobs(logits_of, context, ids[start:end])
        start = end
    return total
