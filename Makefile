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
# The lock's pins as pip constraints: its name==version lines (not its index option, which is
# the images'), local version labels dropped. PyPI has no torch==2.13.0+cpu, only the build
# under the plain version; by PEP 440 the constraint torch==2.13.0 accepts either build, so
# the venv resolves from PyPI alone (tests/test_install_resolves.py checks it does).
CONSTRAINTS := $(VENV)/constraints.txt
# Re-install whenever the dependency list or the pins change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | sha1sum | cut -c1-12)
# Where torch may also come from. Empty: PyPI alone, whose Linux x86_64 torch is the CUDA
# build (GBs of nvidia-* wheels; it runs on CPU too). PyPI has no smaller build of it: for
# the CPU-only one (a few hundred MB) set TORCH_INDEX=https://download.pytorch.org/whl/cpu;
# pip takes its 2.13.0+cpu over PyPI's 2.13.0 (a local label sorts higher).
TORCH_INDEX ?=
# Test processes (pytest-xdist). Much of the suite waits on other processes (Ray, servers,
# subprocess CLIs), so more workers than cores still shortens it; TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 3

.PHONY: venv constraints test demo proto proto-check bench bench-gpu clean

venv: $(STAMP)

constraints: $(CONSTRAINTS)

# Makefile too: a venv whose install failed keeps a constraints file made by an older rule.
$(CONSTRAINTS): $(LOCK) Makefile
	mkdir -p $(@D)
	grep -E '^[A-Za-z0-9_.-]+==' $(LOCK) | sed -E 's/\+[A-Za-z0-9.]+$$//' > $@

# tests/test_install_resolves.py reads this recipe (make -n) and resolves its installs in
# pip's isolated mode, so every `pip install` line here must stay resolvable from PyPI.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and on its own: TORCH_INDEX (when set) is an index for this install only.
	$(PY) -m pip install --quiet torch -c $(CONSTRAINTS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e '.[dev]' -c $(CONSTRAINTS)
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
