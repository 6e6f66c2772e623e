# make serve:      run the four stages locally with the offline tiny model on port 8000.
# make test:       install the system packages the tests need when missing (as root; else it
#                  stops and prints the one command that does), lint, then the whole test
#                  suite (it starts its own stack, and builds and runs the image).
# make image:      build the CPU image (IMAGE) with buildah: no Docker daemon, no registry.
# make image-test: build it, then run it as the chart and the operator do (tests/image).
# All of them create .venv when it is missing.

VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch; on a GPU machine install the CUDA build instead.
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8000
IMAGE ?= localhost/tokenline:cpu
export IMAGE

.PHONY: serve setup test pytest lint format bench dashboards image image-test clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test,bench]'
	# NIXL moves KV between prefill and decode pods (--kv-transfer-config). Its wheel names an
	# unpinned torch, which would pull a CUDA build: its own libraries are all it needs here.
	$(PY) -m pip install -q --no-deps "nixl-cu12==1.5.1"
	touch $@

serve: $(VENV)/.base
	$(VENV)/bin/tokenline serve --model tiny --port $(PORT)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Debian's prometheus (promtool), and buildah, podman, debootstrap and runc for the image.
setup:
	tools/image setup image

# Everything but the image test; `make test` runs it, then the image test (CI runs the two
# targets as its two steps).
pytest: setup lint
	$(PY) -m pytest --ignore=tests/image

test: pytest
	$(MAKE) image-test

image: setup $(VENV)/.base
	PYTHON=$(PY) TORCH_SPEC="$(TORCH_SPEC)" tools/image build

image-test: setup $(VENV)/.test
	$(PY) -m pytest tests/image

bench: $(VENV)/.test
	$(VENV)/bin/tokenline bench --help

# Regenerate the committed Grafana dashboards, alert rules, CRD, RBAC and values schema.
dashboards: $(VENV)/.test
	$(PY) -m tokenline.monitoring.generate
	$(PY) -m tokenline_operator.chartgen

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
