# Two commands do all set-up on a fresh machine:
#   make demo   -> creates .venv, installs qkv (CPU torch), runs `qkv demo`
#   make test   -> creates .venv, installs qkv + test extras, runs ruff and the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 is the CPU build on this machine's disk; the library itself only needs torch>=2.6.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv install install-test demo test lint wheel-check bench clean gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

venv: $(BIN)/python

install: venv
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .

install-test: venv
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"

# Passive OpenMP waiting: spinning threads stall each other when the cores are shared (see README).
demo: install
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(BIN)/qkv demo

lint: install-test
	$(BIN)/ruff check src tests benchmarks

test: install-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -n 2 --dist loadfile -q

# A regular (non-editable) install of the wheel, in a fresh venv outside the checkout, runs shipped commands.
wheel-check: venv
	sh .ci/wheel_check.sh "$(TORCH_SPEC)"

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info

# on a lent CUDA machine (python3 with torch and transformers): the CUDA tests and benchmarks/gpu.py's short
# profile, results as JSON under $$OUT (default ./gpu-check-out), under 8 minutes
gpu-check:
	bash scripts/gpu_check.sh
