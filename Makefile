# The two commands a newcomer needs: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PIP    := $(BIN)/python -m pip --disable-pip-version-check --quiet

# Chaos and the benchmarks need real services; override for yours.
PG_URL    ?= postgresql://postgres@127.0.0.1:5432/postgres
REDIS_URL ?= redis://127.0.0.1:6379/0

.PHONY: demo test compose-test fuzz lint typecheck bench chaos clean install

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
	$(PIP) install -e '.[dev,bench,mcp,agents,langgraph,serve,otel]' 2>&1 | grep -v '^WARNING: Location' || true
	$(BIN)/python -c "import toolledger.cli, toolledger.harness.bench.runner, celery, sqlalchemy, psycopg"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/toolledger demo

# The suite runs in PYTEST_WORKERS processes (pytest-xdist; one per core, at most 4), a test
# file's tests in one of them: most of its time is waiting on workers, leases and sockets, so
# two processes on two cores take about half of it. PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= auto
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile $(PYTEST_ARGS)

# The production stack for real: images built (on a local debootstrapped base), docker-compose
# up with 4 workers, containers killed mid-run, the ledger and the sandbox judged. Needs dockerd.
compose-test: $(STAMP)
	$(BIN)/pytest -m compose tests/acceptance/test_compose_stack.py $(PYTEST_ARGS)

# Hostile input and transcript repair, fuzzed with Hypothesis's large profile (100x the examples
# `make test` runs: 10,000 per input property, 40,000 per repair property).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=large $(BIN)/pytest -m "large or not large" -o timeout=3600 \
		tests/integration/test_hostile_input.py tests/unit/test_repair_properties.py -k "fuzz or propert or transcripts"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/toolledger bench --pg $(PG_URL) --redis $(REDIS_URL)

chaos: $(STAMP)
	$(BIN)/toolledger --db $(PG_URL) --broker $(REDIS_URL) chaos --jobs 10000 --duration 1800 --faults 800 --baseline

clean:
	rm -rf $(VENV) .toolledger .pytest_cache .mypy_cache .ruff_cache build *.egg-info
