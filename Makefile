# Set-up, run and test. `make run` and `make test` are all a fresh machine needs.
SHELL := /bin/bash
# The virtualenv's interpreter: the distribution's optimized CPython when it has one
# (scripts/pick-python.sh says why). An existing .venv keeps the interpreter it was made with.
PYTHON ?= $(shell scripts/pick-python.sh)
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
JS_DIR := tests/js
PY_STAMP := $(VENV)/.requirements-installed
JS_STAMP := $(JS_DIR)/node_modules/.installed
BENCH_JS_DIR := bench/js
BENCH_JS_STAMP := $(BENCH_JS_DIR)/node_modules/.installed

.PHONY: setup test-setup run serve test test-browser-load test-faults test-fuzz load-sse lint \
	format bench bench-compare db db-stop clean

# What mypy checks (configured in pyproject.toml).
TYPED := durable_project streams state yjs spark access subscriptions console tablesync

## Python environment, system packages and the database schema. A development checkout gets a
## `.env` asking for DEBUG (Django's settings read it; production runs without one).
setup: $(PY_STAMP) .env
	@scripts/setup-system.sh
	@$(PY) manage.py migrate --no-input -v 0
	@$(PY) manage.py collectstatic --no-input -v 0

$(PY_STAMP): requirements.txt requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	@touch $@

.env:
	@echo "DJANGO_DEBUG=true" > $@

## Node packages the tests drive (conformance suite, official clients) and what else the tests
## need of the system (Node.js, Chromium for tests/browser).
test-setup: setup $(JS_STAMP)
	@scripts/setup-system.sh --test

$(JS_STAMP): $(JS_DIR)/package.json $(JS_DIR)/package-lock.json
	@scripts/setup-system.sh --test
	cd $(JS_DIR) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

## Development server (daphne through runserver) on http://127.0.0.1:$(PORT).
run: setup
	@echo "Admin: create a user with '$(PY) manage.py createsuperuser', then open http://127.0.0.1:$(PORT)/admin/"
	$(PY) manage.py runserver $(PORT)

## Production server: uvicorn with uvloop and httptools (request heads bounded:
## durable_project/protocol.py), one worker per core, DEBUG off, and a
## secret key of this checkout's own (`.secret-key`, made once) unless DJANGO_SECRET_KEY is set.
WORKERS ?= 2
serve: setup .secret-key
	DJANGO_DEBUG=false DJANGO_SECRET_KEY="$${DJANGO_SECRET_KEY:-$$(cat .secret-key)}" \
	$(VENV)/bin/uvicorn durable_project.asgi:application --host 0.0.0.0 --port $(PORT) \
		--workers $(WORKERS) --loop uvloop --http durable_project.protocol:HttpToolsProtocol \
		--no-access-log --timeout-graceful-shutdown 10

.secret-key:
	@umask 077 && $(PYTHON) -c 'import secrets; print(secrets.token_urlsafe(50))' > $@

## The browser tests' load test appends 200 messages/s for this many seconds (make test keeps
## it short; make test-browser-load runs the full 30 s).
BROWSER_LOAD_SECONDS ?= 10
test: test-setup
	CONSOLE_LOAD_SECONDS=$(BROWSER_LOAD_SECONDS) $(PY) -m pytest

## The console in a real browser under load (tests/browser/test_console_load.py): 200 appends/s
## for 30 s while the stream's page follows; every message must arrive, clicks answered < 200 ms.
test-browser-load: test-setup
	CONSOLE_LOAD_SECONDS=30 $(PY) -m pytest tests/browser/test_console_load.py -v -s

## The fault suite at full strength (docs/reliability.md): kill -9 cycles and PostgreSQL
## restarts under load, a stalled LISTEN connection, SIGTERM, the database unreachable. It runs
## a cluster of its own; `make test` includes a short version (2 kill cycles, 1 restart).
FAULT_KILL_CYCLES ?= 20
FAULT_PG_RESTARTS ?= 3
test-faults: setup
	FAULTS_KILL_CYCLES=$(FAULT_KILL_CYCLES) FAULTS_PG_RESTARTS=$(FAULT_PG_RESTARTS) \
		$(PY) -m pytest tests/faults -m faults -v -s

## The fuzzers (tests/fuzz, docs/reliability.md) at full length: every fuzzer's example count
## times FUZZ_SCALE, and the run fails under FUZZ_MIN_REQUESTS fuzz requests. `make test` runs
## them at scale 1 (under a minute).
FUZZ_SCALE ?= 10
FUZZ_MIN_REQUESTS ?= 10000
test-fuzz: setup
	FUZZ_SCALE=$(FUZZ_SCALE) FUZZ_MIN_REQUESTS=$(FUZZ_MIN_REQUESTS) \
		$(PY) -m pytest tests/fuzz -p no:cacheprovider -rxX

## Idle SSE load check (bench/sse_idle_load.py): one server process, SSE_CONNECTIONS idle
## readers held SSE_HOLD seconds, RSS and database transactions measured. A few minutes.
SSE_CONNECTIONS ?= 10000
SSE_HOLD ?= 60
load-sse: setup
	$(PY) bench/sse_idle_load.py --connections $(SSE_CONNECTIONS) --hold $(SSE_HOLD)

## Lint, formatting and types: what CI checks before the tests. mypy's Django plugin imports
## the settings, so it reads the development ones whatever `.env` says (a fresh clone has none).
lint: $(PY_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	DJANGO_DEBUG=true $(VENV)/bin/mypy $(TYPED)

format: $(PY_STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

## Benchmarks against a running server: make bench URL=http://127.0.0.1:8000
URL ?= http://127.0.0.1:$(PORT)
bench: $(PY_STAMP)
	$(PY) bench/streams_bench.py $(URL)

## This server against the Node reference server, side by side (docs/benchmarks.md). Starts
## both itself; options through ARGS, e.g. make bench-compare ARGS="--quick --only sse,rtt"
bench-compare: $(PY_STAMP) $(BENCH_JS_STAMP)
	@scripts/setup-system.sh
	$(PY) bench/compare.py $(ARGS)

$(BENCH_JS_STAMP): $(BENCH_JS_DIR)/package.json $(BENCH_JS_DIR)/package-lock.json
	@scripts/setup-system.sh --test
	cd $(BENCH_JS_DIR) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

## The project's local PostgreSQL (used when DATABASE_URL is unset).
db: $(PY_STAMP)
	@$(PY) -m durable_project.localdb start

db-stop:
	@$(PY) -m durable_project.localdb stop

clean:
	rm -rf $(VENV) $(JS_DIR)/node_modules $(BENCH_JS_DIR)/node_modules .pytest_cache .ruff_cache
