# Everything runs in .venv, created here from the python3 on PATH.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The PyTorch to install when the venv has none (scripts/install_torch.py decides and says
# what it did): the CPU build from PyTorch's CPU wheel index on a machine without an NVIDIA
# GPU (the default index where that one cannot be reached), the default CUDA build with one.
# TORCH_INDEX_URL forces an index, TORCH_SPEC another version or a local wheel file.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=
# Test files run in this many pytest processes side by side (pytest-xdist, one file per process at
# a time, so a module's shared runs are made once). Two on the 2-core reference machine: most of a
# test's time is waiting on its workers and subprocesses, not computing (17 min serially, 11 min
# in two). 0 runs them in pytest's own process. make test-all runs serially: its capacity runs
# measure each process's memory under a limit.
PYTEST_WORKERS ?= 2

.PHONY: install demo demo-toy demo-finetune demo-finetune-lora demo-capacity test test-all lint clean

# torch 2.15 has no wheels for Python < 3.11 (3.10 reached its end of life in October 2026): say
# so before pip fails somewhere deep in the install.
$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "tango-fairscale needs Python 3.11+, found " + sys.version.split()[0] + ": run make PYTHON=python3.12 (or another 3.10+)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Installs torch only when the venv has none (a torch outside pyproject.toml's range is an
# error rather than a silent swap), then the package with its dev, examples, benchmarks, loggers,
# hf and lora extras (hf: Tango's transformers integration; lora: peft; the tests run both), then
# checks that the environment is consistent.
$(VENV)/.installed: $(BIN)/python pyproject.toml scripts/install_torch.py
	$(BIN)/python scripts/install_torch.py --spec "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)")
	$(BIN)/python -m pip install --quiet -e ".[dev,examples,benchmarks,loggers,hf,lora]"
	$(BIN)/python -m pip check
	@touch $@

install: $(VENV)/.installed

# GPT-2 trained from scratch on a book with FairScale FSDP on 2 CPU workers (2 GPUs where
# there are), then text generated from the trained weights with plain transformers.
demo: install
	cd examples/train_gpt2 && ../../$(BIN)/tango run config.jsonnet -w ../../workspace/train_gpt2
	cd examples/train_gpt2 && ../../$(BIN)/python generate.py ../../workspace/train_gpt2 --prompt "Alice was"

# Fine-tuning a pretrained model and exporting it: a small GPT-2 "pretrained" here (nothing is
# downloaded) on chapters I-VI of the book, fine-tuned with FSDP on chapters VII-XII through
# fairscale::from_pretrained (init_on_meta), written out by export_hf, and text generated from the
# exported directory with plain transformers.
demo-finetune: install
	cd examples/finetune_pretrained && ../../$(BIN)/python make_pretrained.py ../../workspace/pretrained-gpt2
	cd examples/finetune_pretrained && ../../$(BIN)/tango run config.jsonnet -w ../../workspace/finetune_pretrained
	cd examples/finetune_pretrained && ../../$(BIN)/python generate.py ../../workspace/finetune_pretrained/latest/train/work/hf --prompt "The Queen"

# The same with LoRA: peft's adapters on the pretrained GPT-2's attention, the rest frozen; the
# adapter is exported and loaded onto the base model with peft to generate.
demo-finetune-lora: install
	cd examples/finetune_pretrained && ../../$(BIN)/python make_pretrained.py ../../workspace/pretrained-gpt2
	cd examples/finetune_pretrained && ../../$(BIN)/tango run config.jsonnet -w ../../workspace/finetune_lora --ext-var lora=true
	cd examples/finetune_pretrained && ../../$(BIN)/python generate.py ../../workspace/finetune_lora/latest/train/work/adapter --prompt "The Queen"

# The smallest example: a regression model in a few seconds.
demo-toy: install
	cd examples/toy && ../../$(BIN)/tango run config.jsonnet -w ../../workspace/toy

# A GPT-2 that DDP cannot train in 1.4 GiB per process and FSDP (either backend) can: the limit
# (`ulimit -d`, in KiB) is on each whole run, main process included. The DDP run is expected to
# fail; its exit status is ignored.
demo-capacity: install
	-cd examples/capacity && ulimit -d 1468006 && ../../$(BIN)/tango run config.jsonnet -w ../../workspace/capacity-ddp --ext-var engine=ddp
	cd examples/capacity && ulimit -d 1468006 && ../../$(BIN)/tango run config.jsonnet -w ../../workspace/capacity
	cd examples/capacity && ulimit -d 1468006 && ../../$(BIN)/tango run config.jsonnet -w ../../workspace/capacity-fsdp2 --ext-var engine=fsdp2

# `make test` (what CI runs) leaves out three kinds of long end-to-end runs, which `make test-all`
# adds: the memory-budget example (marked `capacity`: minutes under a per-worker memory limit), the
# two-host runs between network namespaces (marked `netns`: they need root; the same tests run
# over loopback in `make test`), and further variants of tests that `make test` runs in one
# variant (marked `extended`: e.g. resharding to 4 workers besides 3, every benchmark config;
# CONTRIBUTING.md lists them). Everything else runs in both, end-to-end `tango run`s included; the
# markers are registered in pyproject.toml.
test: install
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not capacity and not netns and not extended" $(PYTEST_ARGS)

test-all: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check tango_fairscale tests examples benchmarks scripts
	$(BIN)/ruff format --check tango_fairscale tests examples benchmarks scripts
	$(BIN)/mypy tango_fairscale benchmarks scripts

clean:
	rm -rf $(VENV) workspace build *.egg-info
