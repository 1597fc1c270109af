# The two commands of the README: `make serve` and `make test`. Both set up on first use.
# `make notebooks` re-executes the notebooks in full mode and saves them with their outputs
# (ARGS="03 04" picks some).
PYTHON ?= python3
LATEST ?= part15_full
ARGS ?=
# Test worker processes (pytest-xdist), each taking whole test files: most tests are one core's
# Python, so two workers keep a 2-core machine busy. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

.PHONY: setup serve test notebooks
setup: .setup.stamp
.setup.stamp: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(PYTHON)
	@touch $@

serve: setup
	$(PYTHON) -m $(LATEST).server $(ARGS)

test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

notebooks: setup
	$(PYTHON) -m shared.course notebooks $(ARGS)
