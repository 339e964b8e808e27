# moe_lab: the two commands are `make workbook` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PROFILE ?= smoke
comma  := ,

# Without a CUDA device every Triton kernel runs under Triton's interpreter on the CPU.
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifneq ($(HAS_CUDA),1)
export TRITON_INTERPRET := 1
endif
export PYTHONHASHSEED := 0

.PHONY: help install workbook test test-fast compile lab lint clean

help:
	@echo "make workbook   execute every notebook (PROFILE=$(PROFILE)) into build/workbook, write build/RESULTS.md"
	@echo "make test       unit tests and every notebook executed"
	@echo "make compile    every Triton kernel compiled for sm_90 and sm_100 (no GPU needed), into results/compile"
	@echo "make lab        JupyterLab on notebooks/"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch and triton first, by exact version: on a machine without CUDA this takes the CPU build.
# The workbook also installs the test extras: notebook 03 compares against Hugging Face's
# Mixtral block (transformers) and notebook 05 against torchao.
define install_extras
	$(BIN)/python -m pip install --quiet torch==2.13.0 triton==3.7.1
	$(BIN)/python -m pip install --quiet -e ".[$(1)]"
	$(BIN)/python -m moe_lab.workbench.cpu
	@touch $@
endef

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(call install_extras,test)

$(VENV)/.installed-workbook: pyproject.toml | $(BIN)/python
	$(call install_extras,lab$(comma)test)

install: $(VENV)/.installed-workbook

workbook: $(VENV)/.installed-workbook
	$(BIN)/python -m moe_lab workbook --profile $(PROFILE)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -ra

test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "not slow"

# Compiles in a child process with TRITON_INTERPRET=0, whatever this Makefile exports.
compile: $(VENV)/.installed-test
	$(BIN)/python -m moe_lab compile --arch sm_90,sm_100

lab: $(VENV)/.installed-workbook
	cd notebooks && ../$(BIN)/jupyter lab

lint: $(VENV)/.installed-test
	$(BIN)/ruff check moe_lab tests scripts

clean:
	rm -rf build
