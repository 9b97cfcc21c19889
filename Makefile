# The README's two commands: `make demo` (main job) and `make test` (tests). Both install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint protos-check

$(STAMP): pyproject.toml requirements/engines.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,adapters,rdma]'
	# vLLM and SGLang for the engine tests, without their dependency trees (torch stays).
	scripts/install_engines.sh $(BIN)/python
	$(BIN)/python -m refitd.formats.delta  # compile the delta codec's kernels into numba's cache
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/refitd demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PATH=$(abspath $(BIN)):$$PATH scripts/gen_protos.sh --check
	$(BIN)/python -m refitd.formats.delta  # cached kernels: no test process compiles them
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
