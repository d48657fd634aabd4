# Two commands do everything on a fresh machine: `make serve` (the OpenAI-compatible server) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The capital of France is
MAX_TOKENS ?= 64
HOST ?= 127.0.0.1
PORT ?= 8000

# The datasets the tests and benchmarks read (WikiText-2 under wikitext2/); the product finds
# them through this variable only. Default: shared/data beside this checkout, or beside the
# repository it was cloned from (a scratch clone elsewhere), whichever exists.
ORIGIN := $(shell git config --get remote.origin.url 2>/dev/null)
KVSERVE_DATA ?= $(firstword $(wildcard $(abspath ../shared/data) $(if $(ORIGIN),$(abspath $(ORIGIN)/../shared/data))) \
                $(abspath ../shared/data))

.PHONY: serve run test venv system-deps clean bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# CPU torch first, exactly this pin: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# The bundled GGUF on its own Q4_K_M blocks (--weights gguf): faster than fp32 in a fifth of the
# memory (docs/BENCHMARKS.md); WEIGHTS=float runs the fp32 reference.
WEIGHTS ?= gguf

serve: venv
	$(VENV)/bin/kvserve serve --host $(HOST) --port $(PORT) --weights $(WEIGHTS)

run: venv
	$(VENV)/bin/kvserve generate "$(PROMPT)" --max-tokens $(MAX_TOKENS) --weights $(WEIGHTS)

# System packages the tests need: Debian's Chromium for the playground test (Playwright drives
# /usr/bin/chromium; `playwright install` would download a browser of its own).
system-deps:
	@test -x /usr/bin/chromium || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
	  || { $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }; }

# KVSERVE_REQUIRE_KERNELS=1: a C kernel that cannot be built fails its tests instead of skipping them.
test: venv system-deps
	KVSERVE_REQUIRE_KERNELS=1 KVSERVE_DATA="$(KVSERVE_DATA)" $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
