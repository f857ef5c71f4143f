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

.PHONY: install train test test-fast

install:
	@if [ -n "$(TORCH)" ]; then $(PYTHON) -m pip install -q "$(TORCH)"; fi
	$(PYTHON) -m pip install -q -e ".[dev]"

train: install
	$(PYTHON) train.py $(ARGS)

test: install
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

# Everything but the tests marked slow (for a quick local loop; CI runs `make test`).
test-fast:
	$(PYTHON) -m pytest -q -m "not slow" $(PYTEST_ARGS)
