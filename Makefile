# `make train` and `make test` each create .venv and install the package first.
VENV ?= .venv
PYTHON ?= python3
# The local copy when this checkout has one beside it, else the Hub's CIFAR-10 (downloaded and cached by datasets).
LOCAL_DATA := ../shared/data/cifar10-jpeg
DATA ?= $(if $(wildcard $(LOCAL_DATA)),$(LOCAL_DATA),uoft-cs/cifar10)
PROFILE ?= accelerate_configs/cpu.yaml
ARGS ?=

.PHONY: install train test test-fast lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

# --quiet: when the run refuses its input, the launcher exits after the run's one-line error, without a traceback.
train: install
	$(VENV)/bin/accelerate launch --quiet --config_file $(PROFILE) -m cifar_accel.train --dataset_name $(DATA) $(ARGS)

test: install
	$(VENV)/bin/python -m pytest

test-fast: install  # every test that trains nothing, and one tiny end-to-end run (under a minute on 2 cores)
	$(VENV)/bin/python -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
