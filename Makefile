# The two commands (README): `make demo` and `make test`. Both create .venv and install on first use.
# torch is pinned (constraints.txt) so a CPU-only machine gets the CPU wheel and no dependency can
# pull a multi-GB CUDA build. On machines whose pip does not find the CPU wheel by itself, set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := dev,analysis,notebooks,track,launch,gpu,eval
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: demo test lab screenshots venv clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	$(BIN)/python -c "import torch, sys; sys.exit('a CUDA torch build was installed on a CPU-only machine' if torch.version.cuda and not torch.cuda.is_available() else 0)"
	@touch $(STAMP)

# The embedded demo checkpoint, then notebooks 01-05 executed headless (jobs/demo.py).
demo: $(STAMP)
	$(BIN)/python jobs/demo.py

test: $(STAMP)
	bash .ci/test.sh

lab: $(STAMP)
	bash jobs/lab.sh

# Refresh the README's notebook pictures (notebooks/screenshots/*.png) from passing browser tests.
# `make test` never writes there: its screenshots stay in runs/test-artifacts/ (ignored).
screenshots: $(STAMP)
	WORKBENCH_SCREENSHOTS_DIR=$(CURDIR)/notebooks/screenshots $(BIN)/python -m pytest -q -p no:cacheprovider tests/browser -n 0

clean-venv:
	rm -rf $(VENV)
