# The two commands: `make demo` and `make test`. Both bootstrap .venv on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The venv installs the versions the images pin (deploy/docker/lock.py writes them from a
# tested venv; the orchestrator's list holds every other image's pins): without them a
# transitive dependency released upstream lands in a fresh venv, the suite runs versions
# no image has, and tests/deploy's lock check fails on a clean checkout.
LOCK := deploy/docker/requirements/orchestrator.txt
# Re-install whenever the dependency list or the pins change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | sha1sum | cut -c1-12)
TORCH_VERSION := 2.13.0
# Test processes (pytest-xdist). Much of the suite waits on other processes (Ray, servers,
# subprocess CLIs), so more workers than cores still shortens it; TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 3

.PHONY: venv test demo proto proto-check bench bench-gpu clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned resolve pulls GBs of CUDA wheels.
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	# Pins only (no index options): a constraints file for pip.
	grep -E '^[A-Za-z0-9_.-]+==' $(LOCK) > $(VENV)/constraints.txt
	$(PY) -m pip install --quiet -e '.[dev]' -c $(VENV)/constraints.txt
	rm -f $(VENV)/.installed-*
	touch $@

test: $(STAMP)
	# pytest exits 5 when it collects nothing; that must fail, never pass.
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

demo: $(STAMP)
	$(VENV)/bin/specmask demo

proto: $(STAMP)
	$(PY) -m specmask.proto.codegen

proto-check: $(STAMP)
	$(PY) -m specmask.proto.codegen --check

# The GPU-path benchmark (bench/gpu.py). It runs on a bare GPU host with the interpreter that
# has CUDA torch (PYTHON, default python3), not the CPU-only venv; the Llama-3 tokenizer it needs
# is copied once into the git-ignored bench/.tokenizers so that it travels with the tree.
bench-gpu:
	test -f bench/.tokenizers/llama3/tokenizer.json || { mkdir -p bench/.tokenizers/llama3 && \
		cp $${SPECMASK_SHARED_DATA:-../shared/data}/tokenizers/llama3/tokenizer*.json bench/.tokenizers/llama3/; }
	$(PYTHON) -m bench.gpu

clean:
	rm -rf $(VENV) .pytest_cache
