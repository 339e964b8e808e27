# moe_lab: the two commands are `make workbook` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PROFILE ?= smoke
comma  := ,

# The tested set: every package set-up installs where the machine brings no PyTorch of its own
# (on a CPU machine the CPU build of torch), at the version `make test` and CI tested it (pip's
# constraints), and the oldest Triton moe_lab supports, which `make test-compat` tests. They lie
# in pyproject.toml's ranges (tests/project/test_project.py checks it).
CONSTRAINTS    := requirements/ci.txt
TORCH_VERSION  := $(shell sed -n 's/^torch==//p' $(CONSTRAINTS))
TRITON_VERSION := $(shell sed -n 's/^triton==//p' $(CONSTRAINTS))
TRITON_OLDEST  := 3.6.0

# A CUDA build of torch that $(PYTHON) already imports (an NGC container, a cluster module, a GPU
# image): .venv sees it (--system-site-packages), pip installs the project beside it without
# touching torch or triton, and the CPU plug-in is not built. SYSTEM_TORCH=1 takes this route
# with any torch $(PYTHON) imports, SYSTEM_TORCH=0 never takes it.
ifndef SYSTEM_TORCH
SYSTEM_TORCH := $(shell $(PYTHON) -c "import torch; assert torch.version.cuda" >/dev/null 2>&1 && echo 1)
endif

# Without a CUDA device every Triton kernel runs under Triton's interpreter on the CPU. The torch
# that will run (.venv's once it exists, else $(PYTHON)'s) says whether it sees a device; where
# neither has torch yet (the first run), nvidia-smi decides.
TORCH_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
HAS_CUDA := $(shell $(TORCH_PYTHON) -c "import importlib.util as u, sys; \
	u.find_spec('torch') or sys.exit(2); import torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
	>/dev/null 2>&1; found=$$?; if [ $$found = 0 ]; then echo 1; \
	elif [ $$found = 2 ] && nvidia-smi -L >/dev/null 2>&1; then echo 1; fi)
ifneq ($(HAS_CUDA),1)
export TRITON_INTERPRET := 1
endif
export PYTHONHASHSEED := 0

.PHONY: help install workbook test test-fast test-compat wheel-check compile lab lint clean

help:
	@echo "make workbook     execute every notebook (PROFILE=$(PROFILE)) into build/workbook, write build/RESULTS.md"
	@echo "make test         unit tests and every notebook executed"
	@echo "make wheel-check  the wheel installed outside the checkout runs a layer on its CPU plug-in"
	@echo "make test-compat  the kernel tests and the compile report under triton $(TRITON_OLDEST) (.venv-compat)"
	@echo "make compile      every Triton kernel compiled for sm_90 and sm_100 (no GPU needed), into results/compile"
	@echo "make lab          JupyterLab on notebooks/"
	@echo "torch: $(if $(filter 1,$(SYSTEM_TORCH)),$(PYTHON)'s own (SYSTEM_TORCH=1),torch==$(TORCH_VERSION) in .venv)"

ifeq ($(SYSTEM_TORCH),1)
$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

# pip is held to the torch and triton installed (a constraints file written from their
# metadata): a dependency that asked for another torch would fail the install, not replace the
# machine's build. Their lines in pip's output read "Requirement already satisfied".
define install_extras
	@grep -q '^include-system-site-packages = true' $(VENV)/pyvenv.cfg \
	|| { echo "$(VENV) was made without the machine's torch: remove it (rm -rf $(VENV)) and rerun"; exit 1; }
	$(BIN)/python -c "from importlib.metadata import version; \
	print('\n'.join(f'{n}=={version(n)}' for n in ('torch', 'triton')))" > $(VENV)/system-torch.txt \
	|| { echo "SYSTEM_TORCH: $(PYTHON) has no torch and triton distributions to keep (README, Hardware)"; exit 1; }
	$(BIN)/python -m pip install -c $(VENV)/system-torch.txt -e ".[$(1)]"
	$(BIN)/python -c "import sys, torch, triton; \
	inside = [m.__name__ for m in (torch, triton) if m.__file__.startswith(sys.prefix)]; \
	assert not inside, f'{inside} installed into $(VENV)'; \
	print('torch', torch.__version__, 'and triton', triton.__version__, 'used as installed in', sys.base_prefix)"
	@touch $@
endef
else
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch and triton first, by exact version: on a machine without CUDA this takes the CPU build.
# Then the project, every package held to the tested set. The workbook also installs the test
# extras: notebook 04 compares against Hugging Face's Mixtral block (transformers) and notebook
# 06 against torchao.
define install_extras
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) torch==$(TORCH_VERSION) triton==$(TRITON_VERSION)
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e ".[$(1)]"
	$(BIN)/python -m moe_lab.workbench.cpu
	@touch $@
endef
endif

$(VENV)/.installed-test: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(call install_extras,test)

$(VENV)/.installed-workbook: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(call install_extras,lab$(comma)test)

install: $(VENV)/.installed-workbook

workbook: $(VENV)/.installed-workbook
	$(BIN)/python -m moe_lab workbook --profile $(PROFILE)

# The tests run in $(TEST_WORKERS) processes (pytest-xdist; tests/conftest.py gives each its share
# of the cores and keeps the files that share work on one of them); TEST_WORKERS=0 runs them in
# this process, one after another.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

test: $(VENV)/.installed-test
	$(PYTEST) -q -ra

test-fast: $(VENV)/.installed-test
	$(PYTEST) -q -m "not slow"

# The second supported stack: torch $(TORCH_VERSION) with the oldest Triton, in its own venv
# (pip held to both versions). The kernel tests and the compiled-IR checks, then the compile
# report for sm_90 (every spec compiled, registers read two ways and compared; exit 1 on a
# failed or disagreeing row) into build/compat: results/compile stays the main stack's.
COMPAT := .venv-compat
$(COMPAT)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install --quiet --upgrade pip
	{ grep -v '^torch==\|^triton==' $(CONSTRAINTS); printf 'torch==$(TORCH_VERSION)\ntriton==$(TRITON_OLDEST)\n'; } \
		> $(COMPAT)/constraints.txt
	$(COMPAT)/bin/python -m pip install --quiet -c $(COMPAT)/constraints.txt torch==$(TORCH_VERSION) triton==$(TRITON_OLDEST)
	$(COMPAT)/bin/python -m pip install --quiet -c $(COMPAT)/constraints.txt -e ".[test]"
	@touch $@

test-compat: export MOE_LAB_RESULTS_DIR := $(CURDIR)/build/compat/results
test-compat: $(COMPAT)/.installed
	$(COMPAT)/bin/python -c "import torch, triton; print('test-compat: torch', torch.__version__, 'triton', triton.__version__)"
	$(COMPAT)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -q -ra -m "not slow" tests/lesson/kernels \
		tests/workbench/compile_report/test_mx_compiled.py
	$(COMPAT)/bin/python -m moe_lab compile --arch sm_90 --out build/compat/compile

# The wheel as a user gets it: built, installed into a fresh environment beside this torch, its
# CPU plug-in built from the wheel's sources and one MoE layer run through it (CI runs it).
wheel-check: $(VENV)/.installed-test
	$(BIN)/python scripts/wheel_check.py

# Compiles in a child process with TRITON_INTERPRET=0, whatever this Makefile exports.
compile: $(VENV)/.installed-test
	$(BIN)/python -m moe_lab compile --arch sm_80,sm_86,sm_89,sm_90,sm_100

lab: $(VENV)/.installed-workbook
	cd notebooks && ../$(BIN)/jupyter lab

lint: $(VENV)/.installed-test
	$(BIN)/ruff check moe_lab tests scripts

clean:
	rm -rf build
