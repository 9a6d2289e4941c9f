# Two commands do everything on a fresh machine (see README.md):
#   make demo   create .venv and run the main job
#   make test   create .venv, lint, and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(BIN)/fedring simulate --agents 4 --dataset digits --compression group-topk --density 0.01

lint: setup
	$(BIN)/ruff check fedring tests bench examples
	$(BIN)/mypy fedring

test: lint
	$(BIN)/pytest -q

bench: setup
	$(BIN)/fedring bench compress --numel 10000000 --density 0.01
	$(BIN)/fedring simulate --agents 4 --dataset digits --compression group-topk --density 0.01

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
