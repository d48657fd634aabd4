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

.PHONY: serve run test venv system-deps clean bench cuda-compat

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

# The CUDA path's CPU checks (interpreted kernels, sm_90 compiles, the GPU check's dry runs) under
# the GPU machine's versions, in a venv of their own (~3 GB): PyTorch's CUDA build, which pins its
# Triton. numpy < 2.3: Triton 3.6's interpreter takes int() of one-element arrays, which numpy 2.4
# refuses.
CUDA_TORCH ?= 2.11.0
CUDA_VENV ?= .venv-cuda
CUDA_TESTS = tests/test_cuda_check.py tests/test_cuda_graphs.py tests/test_triton_compile.py \
	tests/test_triton_attention.py tests/test_triton_ops.py tests/test_triton_gemv.py tests/test_cuda_path_interpreted.py
cuda-compat:
	test -x $(CUDA_VENV)/bin/python || python3 -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install -q torch==$(CUDA_TORCH)
	$(CUDA_VENV)/bin/pip install -q -e '.[dev]' 'numpy<2.3'
	KVSERVE_REQUIRE_KERNELS=1 KVSERVE_DATA="$(KVSERVE_DATA)" $(CUDA_VENV)/bin/python -m pytest -q $(CUDA_TESTS)

clean:
	rm -rf $(VENV) $(CUDA_VENV) *.egg-info .pytest_cache
