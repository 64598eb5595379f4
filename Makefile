# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch (on this project's machines it comes from local disk).
# With a GPU, set TORCH=torch to let pip pick the build for your CUDA.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin

# The GPU check runs on a machine's own CUDA build of torch (no virtual environment, nothing installed).
GPU_PYTHON ?= python3

.PHONY: setup demo test lint bench gpu-check cli-docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,hf]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/pipefold simulate --plot pipefold-timeline.png

lint: setup
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/mypy

# Two workers: they keep both cores busy (more would only share them further).
# Bytecode compiled once beforehand: where the environment sets PYTHONDONTWRITEBYTECODE, every process the suite
# starts (hundreds) would otherwise compile pipefold's sources again. The type check (one core, half a minute) runs
# beside the tests; its verdict counts as much as theirs.
test: setup
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/python -m compileall -q src >/dev/null
	@$(BIN)/mypy > .mypy.out 2>&1 & typing=$$!; \
	$(BIN)/python -m pytest -n 2; tests=$$?; \
	wait $$typing; types=$$?; cat .mypy.out; rm -f .mypy.out; \
	test $$tests -eq 0 -a $$types -eq 0

bench: setup
	$(BIN)/python benchmarks/bench_simulate.py

# docs/cli.md, written from the parser (a test checks that it is current).
cli-docs: setup
	$(BIN)/python -m pipefold.cli.reference > docs/cli.md

gpu-check:
	PYTHONPATH=src OMP_NUM_THREADS=1 $(GPU_PYTHON) benchmarks/gpu_check.py --out gpu-report

clean:
	rm -rf $(VENV) pipefold-timeline.png
