# moe_lab: the two commands are `make workbook` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PROFILE ?= smoke

# Without a CUDA device every Triton kernel runs under Triton's interpreter on the CPU.
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifneq ($(HAS_CUDA),1)
export TRITON_INTERPRET := 1
endif
export PYTHONHASHSEED := 0

.PHONY: help install workbook test test-fast lab lint clean

help:
	@echo "make workbook   execute every notebook (PROFILE=$(PROFILE)) into build/workbook, write build/RESULTS.md"
	@echo "make test       unit tests and every notebook executed"
	@echo "make lab        JupyterLab on notebooks/"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch and triton first, by exact version: on a machine without CUDA this takes the CPU build.
$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==2.13.0 triton==3.7.1
	$(BIN)/python -m pip install --quiet -e ".[$*]"
	@touch $@

install: $(VENV)/.installed-lab

workbook: $(VENV)/.installed-lab
	$(BIN)/python -m moe_lab workbook --profile $(PROFILE)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -ra

test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "not slow"

lab: $(VENV)/.installed-lab
	cd notebooks && ../$(BIN)/jupyter lab

lint: $(VENV)/.installed-test
	$(BIN)/ruff check moe_lab tests scripts

clean:
	rm -rf build
