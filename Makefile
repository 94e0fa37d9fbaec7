# Two entry points, each doing all of its own set-up on a fresh clone:
#   make run    install, make the tiny models, run the default workflow headless
#   make test   install (with the test extra) and run the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEFAULT_WORKFLOW ?= workflows/h3_t2va.json

.PHONY: run test setup setup-test models clean

$(VENV)/.base: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.test: $(VENV)/.base requirements-test.txt
	$(PY) -m pip install --quiet -r requirements-test.txt
	touch $@

setup: $(VENV)/.base
setup-test: $(VENV)/.test

models: setup
	$(PY) -m models.h3.make_tiny

run: setup models
	$(PY) main.py run $(DEFAULT_WORKFLOW)

test: setup-test
	$(PY) -m pytest

clean:
	rm -rf $(VENV)
