# Two commands do all the set-up on a fresh machine:
#   make demo   - install, start the platform on the embedded defaults, run the example workload
#   make test   - install, make sure PostgreSQL and Redis run, run the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

$(BIN)/gpufleet: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-cache-dir --upgrade pip
	$(BIN)/pip install -q --no-cache-dir -e '.[examples,sim,dev,ddp]'
	touch $@

install: $(BIN)/gpufleet

demo: install
	$(BIN)/gpufleet demo

services:
	scripts/ensure-services.sh

# three workers on two cores: most e2e tests wait on real processes (heartbeats, grace
# periods, fence timeouts) rather than compute; the 30 slowest are listed at the end
test: install services
	$(BIN)/pytest -q -n 3 --dist worksteal --timeout 300 --durations=30

lint: install
	$(BIN)/ruff check src tests
	$(BIN)/mypy src
	$(BIN)/lint-imports

.PHONY: install demo services test lint
