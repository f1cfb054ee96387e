# `make run`: set up and run the main job; `make test`: set up and run the tests.
# Set-up is idempotent, in a venv in .venv:
# - where $(PYTHON) already has torch >= 2.11 (a GPU image, with its CUDA build and triton), the
#   venv sees that environment's packages through a .pth file (--system-site-packages would
#   reach only the base interpreter's when $(PYTHON) is itself a venv) and only moe_ops is
#   installed, without dependencies, so no registry is needed;
# - elsewhere (CI, a fresh CPU machine) torch 2.13.0 is pinned first, so that no requirement
#   below can pull a multi-GB CUDA build, then the package with its test extras.
# The package is installed editable without build isolation, against that torch.
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

HAS_SYSTEM_TORCH := $(shell $(PYTHON) -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 11))' 2>/dev/null && echo yes)

$(STAMP): pyproject.toml Makefile
ifeq ($(HAS_SYSTEM_TORCH),yes)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PYTHON) -c 'import site; print("\n".join(site.getsitepackages()))' \
	  > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/parent-env.pth"
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
else
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_PIN)" "$(TRITON_PIN)" "$(NUMPY_PIN)"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,bench]" "$(TORCH_PIN)" "$(NUMPY_PIN)"
endif
	touch $(STAMP)

run: setup
	$(PY) benchmarks/run_layer.py

# (--durations: the slowest tests listed last, to keep CI's run within its 15 minutes)
test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=15 tests

clean:
	rm -rf $(VENV) build *.egg-info
