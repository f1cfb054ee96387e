# `make run`: set up and run the main job; `make test`: set up and run the tests.
# Set-up is idempotent: a venv in .venv with the CPU build of torch pinned first, so that no
# requirement below can pull a multi-GB CUDA build; the package itself is installed editable
# without build isolation, against that torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moe_ops-setup
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.6.0
# numpy>=2.4 breaks Triton 3.6's interpreter ("only 0-dimensional arrays can be converted...").
NUMPY_PIN := numpy<2.4
PYTEST_WORKERS ?= 2

.PHONY: run test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_PIN)" "$(TRITON_PIN)" "$(NUMPY_PIN)"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,bench]" "$(TORCH_PIN)" "$(NUMPY_PIN)"
	touch $(STAMP)

run: setup
	$(PY) benchmarks/run_layer.py

test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests

clean:
	rm -rf $(VENV) build *.egg-info
