# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000
BENCH_ARGS ?=
PROMPT ?= Explain in two sentences what a KV cache is.

.PHONY: run triton generate test lint bench install clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned in pyproject.toml to the CPU wheel these machines carry.
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/tokenmill models pull $(MODEL)
	$(BIN)/tokenmill kernels
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/tokenmill serve --model $(MODEL) --host $(HOST) --port $(PORT)

# The OpenAI API plus the example KServe v2 model repository (its ONNX model is built first).
triton: $(STAMP)
	$(BIN)/python examples/make_onnx_model.py
	$(BIN)/tokenmill serve --model $(MODEL) --host $(HOST) --port $(PORT) --model-repository examples/model_repository

generate: $(STAMP)
	$(BIN)/tokenmill generate "$(PROMPT)" --model $(MODEL) --max-tokens 96

test: $(STAMP)
	$(BIN)/ruff check tokenmill tests benchmarks examples
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check tokenmill tests benchmarks examples
	$(BIN)/ruff format --check tokenmill tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
