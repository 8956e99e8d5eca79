# Two entry points: `make chat` (the chat app on the embedded pair, offline) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup chat test test-all

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[tui,test,reference]"
	touch $@

setup: $(VENV)/.installed

chat: setup
	$(VENV)/bin/dflash-chat

test: setup
	$(PY) -m pytest

test-all: setup
	$(PY) -m pytest -m ""
