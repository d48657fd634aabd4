# Two commands do everything on a fresh machine: `make serve` (the OpenAI-compatible server) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The capital of France is
MAX_TOKENS ?= 64
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve run test venv clean bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# CPU torch first, exactly this pin: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

serve: venv
	$(VENV)/bin/kvserve serve --host $(HOST) --port $(PORT)

run: venv
	$(VENV)/bin/kvserve generate "$(PROMPT)" --max-tokens $(MAX_TOKENS)

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
