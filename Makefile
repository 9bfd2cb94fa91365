# rollout-pipeline: `make demo` and `make test` work from a fresh clone.
# They create .venv, install the project, start a local Kafka broker when no bootstrap
# address is configured (ROLLOUT_KAFKA__BOOTSTRAP_SERVERS), run, and stop what they started.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ROLLOUT := $(VENV)/bin/rollout
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: install test test-unit lint demo chaos load clean kafka-up kafka-down

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

# The test session starts its own broker on a free port and stops it at the end,
# unless ROLLOUT_TEST_BOOTSTRAP names an existing cluster.
test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check schemas pipeline workers tests
	$(VENV)/bin/ruff format --check schemas pipeline workers tests

demo: install
	$(PY) -m pipeline.demo

kafka-up: install
	$(ROLLOUT) kafka up

kafka-down: install
	$(ROLLOUT) kafka down

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
