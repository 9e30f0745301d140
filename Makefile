# `make demo` and `make test` create (or reuse) .venv, install the project, then run.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
WHEEL   = build/wheel
WHEELENV = build/wheel-venv
# pytest-xdist workers: one process alone keeps ~1.3 of the 2 cores busy (compiles are serial)
WORKERS ?= 2

.PHONY: demo test test-slow test-all install clean wheel-check strip-notebooks

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hapsynth demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal
	$(MAKE) wheel-check

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal -m slow

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) -m "slow or not slow"

# notebooks are committed without outputs (tests/test_notebooks.py checks)
strip-notebooks: $(STAMP)
	$(BIN)/nbstripout --keep-id notebooks/*.ipynb

# a non-editable install works: the wheel, installed with its dependencies in a fresh
# venv, runs the CLI (presets are package data, bench is hapsynth_bench) outside the repo
wheel-check: $(STAMP)
	rm -rf $(WHEEL) $(WHEELENV) build/lib build/bdist.*
	$(BIN)/python -m pip wheel -q --no-deps -w $(WHEEL) .
	$(PYTHON) -m venv $(WHEELENV)
	$(WHEELENV)/bin/python -m pip install -q $(WHEEL)/hapsynth-*.whl
	H=$(abspath $(WHEELENV))/bin/hapsynth; D=$$(mktemp -d); trap 'rm -rf "$$D"' EXIT; \
	cd "$$D" && set -x && $$H inspect mlp && \
	$$H plan mlp --config tiny --cluster cpu-2-6 --time-limit 1 && \
	$$H bench overhead --help > /dev/null

clean:
	rm -rf $(VENV) build *.egg-info
