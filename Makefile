# Two entry points, each bootstrapping .venv on first use:
#   make demo   -- generate text with the embedded demo model
#   make test   -- the whole test suite (CPU)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PROMPT ?= And God said

.PHONY: demo test clean-venv

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

clean-venv:
	rm -rf $(VENV)
