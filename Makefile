# Every target sets up what it needs: on a fresh machine `make demo` and `make test` are enough.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint format schemas bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,reward,plot,dev]'
	touch $(STAMP)

demo: setup
	$(PY) -m artery.demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Regenerate the JSON Schema and AsyncAPI documents from schemas/ (commit the result).
schemas: setup
	$(PY) -m artery.schemas.generate

test: setup lint
	$(PY) -m artery.schemas.generate --check
	$(PY) -m pytest -q

bench: setup
	$(PY) -m loadtests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
