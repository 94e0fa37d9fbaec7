# Two entry points, each doing all of its own set-up on a fresh clone:
#   make run    install, make the tiny models (once), run the default workflow headless
#   make test   install (with the test extra) and run the whole test suite, one pytest worker per CPU
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

# The tiny models (Weft's own and, under the released names, what the official H3 templates load, with
# their example input pictures) are written once; they are made again only when their writers change.
TINY_STAMP := models/.tiny-written
$(TINY_STAMP): $(VENV)/.base models/h3/make_tiny.py models/h3/tiny_released.py execution/templates.py
	$(PY) -m models.h3.make_tiny
	$(PY) -m models.h3.make_tiny --released-formats
	$(PY) main.py templates --write-examples input
	touch $@

models: setup $(TINY_STAMP)

run: setup models
	$(PY) main.py run $(DEFAULT_WORKFLOW)

# pytest-xdist spreads the tests over the CPUs (`-n auto`); each worker has its own temporary folders and
# every server or Ray instance a test starts binds a free port, so the tests do not meet.
test: setup-test
	$(PY) -m pytest -n auto

clean:
	rm -rf $(VENV)
