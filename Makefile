# gpuscout: two set-up commands on a fresh machine, `make demo` and `make test`. Each installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
export PYTHONDONTWRITEBYTECODE := 1
export MPLBACKEND := Agg

.PHONY: demo test check lint format types synth install clean

$(VENV)/.stamp-install: requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

node_modules/.stamp-install: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

install: $(VENV)/.stamp-install node_modules/.stamp-install

## The main job: a local benchmark end to end on the embedded default manifest.
demo: $(VENV)/.stamp-install
	$(BIN)/gpuscout local configs/manifests/quickstart.yaml

## Every test (unit, infra, integration, training).
test: install
	$(BIN)/pytest -n 2 --dist loadfile -q

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format:
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

types:
	$(BIN)/mypy
	MYPYPATH=training $(BIN)/mypy training/*.py benchmarks/*.py app.py

## Lint + types + tests.
check: install lint types test

synth: install
	npx cdk synth --quiet

clean:
	rm -rf $(VENV) node_modules cdk.out runs .pytest_cache .mypy_cache .ruff_cache .hypothesis
