# The two commands of the README: `make serve` and `make test`. Both set up on first use.
PYTHON ?= python3
LATEST ?= part04_continuous_batching
ARGS ?=

.PHONY: setup serve test
setup: .setup.stamp
.setup.stamp: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(PYTHON)
	@touch $@

serve: setup
	$(PYTHON) -m $(LATEST).server $(ARGS)

test: setup
	$(PYTHON) -m pytest -q $(ARGS)
