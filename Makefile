# gpuscout: two set-up commands on a fresh machine, `make demo` and `make test`. Each installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
unexport PYTHONDONTWRITEBYTECODE
export MPLBACKEND := Agg

.PHONY: demo test check lint format types synth install clean gpu-check gpu-wheels gpu-memory-probe warm-bytecode lock lock-image

## --no-compile: pip would compile all ~20,000 files it installs to bytecode, one at a time (most of the install's
## time). Python compiles a module the first time it is
## imported and keeps it in __pycache__, so only what runs is compiled, once. That needs bytecode writing on: these
## machines' environment sets PYTHONDONTWRITEBYTECODE=1, so make passes it to no recipe (unexport above).
## Everything the install runs is pinned: pip; constraints.txt (make lock) holds every package the requirements
## bring, their dependencies' too; build-constraints.txt the setuptools that builds from source (the editable gpuscout
## and DeepSpeed's source release). Without them, the index's newest of the day would make two fresh clones of one
## commit install differently (where /opt/wheels has no torch CPU wheel, torch==2.13.0 is PyPI's CUDA build, whose
## CUDA packages the lock does not hold).
PIP_PIN := pip==26.3
PIP_PINNED := --quiet --no-compile -c constraints.txt --build-constraint build-constraints.txt
$(VENV)/.stamp-install: requirements.txt requirements-dev.txt constraints.txt build-constraints.txt pyproject.toml
	test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install --quiet --no-compile $(PIP_PIN)
	$(VENV_PY) -m pip install $(PIP_PINNED) -r requirements-dev.txt
	$(VENV_PY) -m pip install $(PIP_PINNED) --no-deps -e .
	$(MAKE) --no-print-directory warm-bytecode
	touch $@

## The heavy stacks' modules compiled once, at install, one process per core. Left to the first imports, processes
## that start together (the two test workers, torchrun's ranks, a search's trials) each compiled the same modules,
## which cost more than this step's seconds. The modules are imported, not compiled wholesale: only what runs is
## compiled.
## aws_cdk stays out: importing it starts Node.js (jsii), which `make demo` does not need. MLflow's telemetry is off
## here (it would write an install id). tests/unit/test_suite_environment.py checks that each name here exists.
WARM_TRAINING := torch._dynamo transformers.models.qwen2.modeling_qwen2 transformers.trainer deepspeed
WARM_CLOUD := moto cfnlint.api mlflow wandb optuna boto3 matplotlib.pyplot
IMPORT_EACH := $(VENV_PY) -c 'import sys, importlib; [importlib.import_module(m) for m in sys.argv[1:]]'
warm-bytecode:
	@export MLFLOW_DISABLE_TELEMETRY=true; log=$(VENV)/warm-bytecode.log; start=$$SECONDS; \
	( $(IMPORT_EACH) $(WARM_TRAINING) & pid=$$!; $(IMPORT_EACH) $(WARM_CLOUD); \
	  cloud=$$?; wait $$pid && exit $$cloud ) > $$log 2>&1 \
	  || { cat $$log; echo "warm-bytecode: importing the libraries failed (above); the install is broken" >&2; exit 1; }; \
	echo "compiled the libraries' bytecode in $$((SECONDS - start)) s"

node_modules/.stamp-install: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

install: $(VENV)/.stamp-install node_modules/.stamp-install

## constraints.txt: the versions a fresh install of requirements-dev.txt resolves today, dependencies included
## (setuptools too, which torch requires at run time; local version labels such as torch's +cpu dropped:
## requirements.txt pins torch==2.13.0). Run after changing a requirements file: it installs into a throwaway venv
## (about a minute), leaves .venv alone and replaces constraints.txt only when the freeze succeeded.
lock:
	set -euo pipefail; venv=$$(mktemp -d /tmp/gpuscout-lock.XXXXXX); trap 'rm -rf "$$venv"' EXIT; \
	$(PYTHON) -m venv "$$venv"; \
	"$$venv/bin/python" -m pip install --quiet --no-compile $(PIP_PIN); \
	"$$venv/bin/python" -m pip install --quiet --no-compile --build-constraint build-constraints.txt \
	  -r requirements-dev.txt; \
	{ echo "# Every package make install brings, at the versions of a fresh install (make lock writes this file)."; \
	  echo "# make install installs requirements-dev.txt with it as constraints (-c)."; \
	  "$$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v '^pip==' \
	    | sed -E 's/^([^=]+==[^+]+)\+.*$$/\1/'; \
	} > constraints.txt.new; \
	mv constraints.txt.new constraints.txt; \
	echo "constraints.txt: $$(grep -vc '^#' constraints.txt) packages"

## training/constraints.txt: the training image's lock. Every package training/requirements.txt brings, for the
## image's CPython 3.12 on x86_64 Linux, at constraints.txt's versions wherever both hold one (the image runs what the
## tests run), resolved by uv in a throwaway venv; torch's own CUDA stack (torch, triton, nvidia-* but nvidia-ml-py,
## cuda-*) is left out: the base image's build of torch brings it. Run after changing training/requirements.txt.
UV_PIN := uv==0.13.9
lock-image:
	set -euo pipefail; venv=$$(mktemp -d /tmp/gpuscout-lock-image.XXXXXX); trap 'rm -rf "$$venv"' EXIT; \
	$(PYTHON) -m venv "$$venv"; \
	"$$venv/bin/python" -m pip install --quiet --no-compile $(UV_PIN); \
	"$$venv/bin/uv" pip compile training/requirements.txt -c constraints.txt --python-version 3.12 \
	  --python-platform x86_64-manylinux_2_28 --no-header --no-annotate --quiet -o "$$venv/lock.txt"; \
	{ echo "# The training image's lock (make lock-image writes this file): training/Dockerfile installs"; \
	  echo "# training/requirements.txt with it as constraints (-c). torch's CUDA stack is the base image's."; \
	  grep -Ev '^(torch|triton|cuda-[a-z-]+|nvidia-(cu|nv|nccl)[a-z0-9-]*)==' "$$venv/lock.txt"; \
	} > training/constraints.txt.new; \
	mv training/constraints.txt.new training/constraints.txt; \
	echo "training/constraints.txt: $$(grep -vc '^#' training/constraints.txt) packages"

## The main job: a local benchmark end to end on the embedded default manifest.
demo: $(VENV)/.stamp-install
	$(BIN)/gpuscout local configs/manifests/quickstart.yaml
	@echo "gpuscout is $(BIN)/gpuscout: run 'source $(VENV)/bin/activate' for the 'next:' commands above as printed"

## Every test (unit, infra, integration, training), on the kernels of the slowest CPU in the pool on every machine:
## oneDNN capped at AVX2 (bf16 matmuls on its reference path, as on AVX2-only AMD EPYCs) and ATen's AVX2 kernels,
## so a developer sees the time CI will see. tests/unit/test_suite_environment.py checks both are set.
test: export ONEDNN_MAX_CPU_ISA := AVX2
test: export ATEN_CPU_CAPABILITY := avx2
## Two workers on two cores: one OpenMP thread per training process (the jobs gpuscout local starts would take two
## each, and their threads' spin-waits cost CPU when both cores are busy).
test: export OMP_NUM_THREADS := 1
## --max-worker-restart=0: a worker ended by the per-test timeout fails the run naming its test (xdist 3.8 re-runs a
## crashed worker's file on a replacement under --dist loadfile and then hangs). --no-loadscope-reorder keeps the
## longest-first file order of tests/conftest.py (xdist would put files with the most tests first).
## Lint (ruff: seconds) and types (mypy: under a minute cold, seconds with its cache) first, so CI (.ci/run runs
## `make test`) gates what `make check` gates.
test: install lint types
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0 -q --durations=15

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format:
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

types: install
	$(BIN)/mypy
	$(BIN)/mypy benchmarks/*.py app.py

## Lint + types + tests (what `make test` runs; kept for habit).
check: install lint types test

## Wheels for `make gpu-check` on a GPU machine with no package index (benchmarks/gpu_wheels.py): the dependency
## closure of benchmarks/gpu-check-requirements.txt for that machine's Python (PY) except its own torch, triton and
## numpy, into .whl/ (gpu-check installs .whl/*.whl). Needs a package index here; about a minute.
PY ?= 3.12
gpu-wheels: install
	$(BIN)/python benchmarks/gpu_wheels.py --python-version $(PY) --out .whl

## CUDA-only checks, a short Hopper smoke and the three fused losses timed on an NVIDIA GPU, on the machine's own
## torch (benchmarks/gpu_check.py): an overlay env in front of the machine's site-packages gets
## benchmarks/gpu-check-requirements.txt with their dependencies (from .whl/ offline, else the index; torch, triton
## and numpy held at the machine's versions), then every step runs even when one fails, and one JSON,
## benchmarks/results/gpu-check-<gpu>-<date>[-NAME].json, holds them all. GPU_CHECK_STEPS picks steps (one
## 10-minute call each, docs/performance.md "First hour"; GPU_CHECK_BUDGET_S keeps the steps inside one);
## GPU_CHECK_FLAGS=--no-gpu-ok runs it on a CPU.
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= benchmarks/results
GPU_ENV ?= /tmp/gpuscout-gpu-env
GPU_CHECK_STEPS ?= install,cuda-tests,smoke,loss-paths
GPU_CHECK_NAME ?=
GPU_CHECK_FLAGS ?=
GPU_CHECK_BUDGET_S ?= 560
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --env-dir $(GPU_ENV) --out $(GPU_CHECK_OUT) --steps $(GPU_CHECK_STEPS) \
	  --budget-s $(GPU_CHECK_BUDGET_S) \
	  $(if $(GPU_CHECK_NAME),--name $(GPU_CHECK_NAME)) $(GPU_CHECK_FLAGS)

## The planner's memory model against what CUDA really holds: peak memory of a grid of Qwen2.5-0.5B/1.5B training
## configurations (flex, SDPA, Liger, full logits, checkpointing; the planner's prediction beside each), in
## gpu-check's overlay env; writes benchmarks/results/memory-probe-gpu-<date>.json. A few minutes.
gpu-memory-probe:
	$(GPU_PYTHON) benchmarks/gpu_check.py --env-dir $(GPU_ENV) --out $(GPU_CHECK_OUT) --steps install,memory-probe \
	  --budget-s $(GPU_CHECK_BUDGET_S) --name memory-probe $(GPU_CHECK_FLAGS)

synth: install
	npx cdk synth --quiet

clean:
	rm -rf $(VENV) node_modules cdk.out runs .pytest_cache .mypy_cache .ruff_cache .hypothesis
