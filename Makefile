# Everything runs in .venv, created here from the python3 on PATH.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The PyTorch build to install when the venv has none. A bare `pip install torch` pulls the
# multi-GB CUDA build; point TORCH_INDEX_URL at a CPU wheel index (or leave TORCH_SPEC to a
# local wheel) to avoid that, e.g. make demo TORCH_INDEX_URL=<your CPU wheel index>.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=

.PHONY: install demo demo-toy test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Installs a CPU torch only when the venv has no torch at all, then the package with its
# dev and examples extras, then checks that the environment is consistent.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	@$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,examples,benchmarks]"
	$(BIN)/python -m pip check
	@touch $@

install: $(VENV)/.installed

# GPT-2 trained from scratch on a book with FairScale FSDP on 2 CPU workers (2 GPUs where
# there are), then text generated from the trained weights with plain transformers.
demo: install
	cd examples/train_gpt2 && ../../$(BIN)/tango run config.jsonnet -w ../../workspace/train_gpt2
	cd examples/train_gpt2 && ../../$(BIN)/python generate.py ../../workspace/train_gpt2 --prompt "Alice was"

# The smallest example: a regression model in a few seconds.
demo-toy: install
	cd examples/toy && ../../$(BIN)/tango run config.jsonnet -w ../../workspace/toy

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check tango_fairscale tests examples benchmarks
	$(BIN)/ruff format --check tango_fairscale tests examples benchmarks
	$(BIN)/mypy tango_fairscale benchmarks

clean:
	rm -rf $(VENV) workspace build *.egg-info
