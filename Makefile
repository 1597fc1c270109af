# The two commands of the README: `make serve` and `make test`. Both set up on first use.
# `make notebooks` re-executes the notebooks in full mode and saves them with their outputs
# (ARGS="03 04" picks some).
PYTHON ?= python3
LATEST ?= part15_full
ARGS ?=

.PHONY: setup serve test notebooks
setup: .setup.stamp
.setup.stamp: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(PYTHON)
	@touch $@

serve: setup
	$(PYTHON) -m $(LATEST).server $(ARGS)

test: setup
	$(PYTHON) -m pytest -q $(ARGS)

notebooks: setup
	$(PYTHON) -m shared.course notebooks $(ARGS)
