# Two entry points, each bootstrapping .venv on first use:
#   make demo   -- generate text with the embedded demo model
#   make test   -- the whole test suite (CPU), then the Mosaic GPU kernels' interpret-mode
#                  tests under jax 0.11.2 (make test-mosaic)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PROMPT ?= And God said

.PHONY: demo test test-mosaic clean-venv

# The Mosaic GPU kernels' CPU interpreter needs jax >= 0.11 (the GPU machine's 0.11.2), which
# pip offers only from Python 3.12; .venv's jax (0.10.2 on Python 3.11) skips those modules.
# So they run again in a Python 3.12 environment of their own, without torch (they need none).
# (the first candidate that runs: a pyenv shim may exist and still refuse to run; looked up
# once per make, and handed to the sub-make)
ifndef PY312
PY312 := $(shell for p in python3.12 $(wildcard /root/.pyenv/versions/3.12*/bin/python3.12); do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo $$p && break; done)
endif
MOSAIC_VENV := .venv-mosaic
# (test_gemm.py, test_add_norm.py and test_rope_kv.py also run here: the skinny GEMM's masked
# loads and stores and the batch-invariant mode's kernels under jax 0.11.2, the GPU machine's
# version, as well as 0.10.2)
MOSAIC_TESTS := tests/test_chain_attention.py tests/test_chain_mgpu.py tests/test_decode_mgpu.py \
	tests/test_decode_mgpu_paged.py tests/test_gemv_mgpu.py tests/test_gemv_mgpu_areg.py \
	tests/test_persistent.py tests/test_projections_mgpu.py \
	tests/test_gemm.py tests/test_add_norm.py tests/test_rope_kv.py

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch (a local file on this kind of machine); other requests pull CUDA builds.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python -m ouro_jax.generate --prompt "$(PROMPT)" --max-tokens 48 \
	  --temperature 0.7 --top-p 0.9 --seed 1 --speculative-k 4 --draft-loops 2

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n 2 --durations=15 tests
	@if [ -n "$(PY312)" ]; then $(MAKE) --no-print-directory test-mosaic PY312=$(PY312); else \
	  echo "NOTE: no python3.12 here, so the Mosaic GPU interpret tests did not run (make test-mosaic PY312=...)"; fi

$(MOSAIC_VENV)/bin/.installed: pyproject.toml Makefile
	@test -n "$(PY312)" || { echo "test-mosaic: no python3.12 found (set PY312=...)"; exit 1; }
	$(PY312) -m venv $(MOSAIC_VENV)
	$(MOSAIC_VENV)/bin/python -m pip install -q --upgrade pip
	$(MOSAIC_VENV)/bin/python -m pip install -q 'jax==0.11.2' absl-py 'pytest>=8' 'pytest-xdist>=3' -e .
	touch $@

test-mosaic: $(MOSAIC_VENV)/bin/.installed
	$(MOSAIC_VENV)/bin/python -m pytest -q -n 2 -p no:cacheprovider $(MOSAIC_TESTS)

clean-venv:
	rm -rf $(VENV) $(MOSAIC_VENV)
