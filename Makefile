# Set-up, run and test. `make run` and `make test` are all a fresh machine needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
JS_DIR := tests/js
PY_STAMP := $(VENV)/.requirements-installed
JS_STAMP := $(JS_DIR)/node_modules/.installed
BENCH_JS_DIR := bench/js
BENCH_JS_STAMP := $(BENCH_JS_DIR)/node_modules/.installed

.PHONY: setup test-setup run serve test lint format bench bench-compare db db-stop clean

## Python environment, system packages and the database schema.
setup: $(PY_STAMP)
	@scripts/setup-system.sh
	@$(PY) manage.py migrate --no-input -v 0
	@$(PY) manage.py collectstatic --no-input -v 0

$(PY_STAMP): requirements.txt requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	@touch $@

## Node packages the tests drive (conformance suite, official clients).
test-setup: setup $(JS_STAMP)

$(JS_STAMP): $(JS_DIR)/package.json $(JS_DIR)/package-lock.json
	@scripts/setup-system.sh --test
	cd $(JS_DIR) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

## Development server (daphne through runserver) on http://127.0.0.1:$(PORT).
run: setup
	@echo "Admin: create a user with '$(PY) manage.py createsuperuser', then open http://127.0.0.1:$(PORT)/admin/"
	$(PY) manage.py runserver $(PORT)

## Production server: uvicorn with uvloop and httptools, one worker per core.
WORKERS ?= 2
serve: setup
	$(VENV)/bin/uvicorn durable_project.asgi:application --host 0.0.0.0 --port $(PORT) \
		--workers $(WORKERS) --loop uvloop --http httptools --no-access-log

test: test-setup
	$(PY) -m pytest

lint: $(PY_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

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
