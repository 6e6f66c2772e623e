# make serve: run the four stages locally with the offline tiny model on port 8000.
# make test:  lint, then the whole test suite (it starts its own stack).
# Both create .venv when it is missing.

VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch; on a GPU machine install the CUDA build instead.
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8000

.PHONY: serve test lint format bench dashboards clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

serve: $(VENV)/.base
	$(VENV)/bin/tokenline serve --model tiny --port $(PORT)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest

bench: $(VENV)/.test
	$(VENV)/bin/tokenline bench --help

# Regenerate the committed Grafana dashboards, alert rules, CRD, RBAC and values schema.
dashboards: $(VENV)/.test
	$(PY) -m tokenline.monitoring.generate
	$(PY) -m tokenline_operator.chartgen

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
