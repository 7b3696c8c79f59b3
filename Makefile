# gdn-aot: `make build` compiles the kernels ahead of time, `make test` runs the CPU test suite.
#   make build [ARCH=sm_90|sm_100|sm_103|all] [SPEC=specs/qwen35.yaml] [OUT=artifacts] [JOBS=N]
#   make test | make wheel | make wheel-with-artifacts [ARTIFACTS=artifacts] | make bench [BENCH_ARGS=...] | make clean
# The first run bootstraps .venv (python3 -m venv; torch, triton==3.6.0, ...); later runs reinstall nothing,
# and only the project itself (a quick, non-editable `pip install --no-deps .`) when its sources change.

PYTHON ?= python3
VENV   ?= .venv
ARCH   ?= all
SPEC   ?= specs/qwen35.yaml
OUT    ?= artifacts
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST_ARGS ?=
ARTIFACTS ?= $(OUT)

PY  := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
DEPS := torch==2.13.0 triton==3.6.0 click pyyaml jinja2 pytest numpy hatchling
DEPS_STAMP := $(VENV)/.stamp-deps
# the nvdisasm the build's SASS analysis runs (triton's 12.8 cannot decode sm_103a; build/toolchain.py pins the
# same version), on a stamp of its own so that a .venv bootstrapped before it gets it too
NVDISASM_DEP := nvidia-cuda-nvdisasm==13.5.37
NVDISASM_STAMP := $(VENV)/.stamp-$(subst ==,-,$(NVDISASM_DEP))
PROJECT_STAMP := $(VENV)/.stamp-project
PROJECT_SRC := pyproject.toml $(shell find kernels build loader specs -type f \
	-not -path '*/__pycache__/*' -not -name '*.pyc' 2>/dev/null)

BENCH_ARGS ?=

.PHONY: all build test wheel wheel-with-artifacts clean install
all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): | $(PY)
	$(PIP) install $(DEPS)
	touch $@

$(NVDISASM_STAMP): $(DEPS_STAMP)
	$(PIP) install $(NVDISASM_DEP)
	touch $@

$(PROJECT_STAMP): $(DEPS_STAMP) $(NVDISASM_STAMP) $(PROJECT_SRC)
	$(PIP) install --no-deps --no-build-isolation --force-reinstall .
	touch $@

install: $(PROJECT_STAMP)

build: $(PROJECT_STAMP)
	$(VENV)/bin/gdn-aot build $(SPEC) --arch $(ARCH) --out $(OUT) -j $(JOBS)

test: $(PROJECT_STAMP)
	$(PY) -m pytest -rsx tests $(PYTEST_ARGS)

wheel: $(DEPS_STAMP)
	$(PIP) wheel --no-deps --no-build-isolation -w .whl .
	@ls -1 .whl/*.whl

# The wheel plus the verified runtime files of $(ARTIFACTS) as package data gdn_aot/artifacts/<arch>/, tagged for
# this platform (the launcher is a native library): dist/gdn_aot-<version>-py3-none-linux_x86_64.whl.
# Installs and runs without triton (docs/deploy.md).
wheel-with-artifacts: wheel $(PROJECT_STAMP)
	$(VENV)/bin/gdn-aot package $(ARTIFACTS) --wheel $$(ls -t .whl/gdn_aot-*-py3-none-any.whl | head -1) --out dist

clean:
	rm -rf $(OUT) dist .whl/gdn_aot-*.whl .venv-notriton
	find . -path ./$(VENV) -prune -o -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# make bench [BENCH_ARGS="--quick --out bench.json"]: gdn_aot against FlashInfer and fla on a CUDA GPU (bench/README.md).
# Where gdn_aot is installed from the wheel instead, run it directly: python3 bench/bench.py [--out F] [--quick]
.PHONY: bench
bench: $(PROJECT_STAMP)
	$(PY) bench/bench.py $(BENCH_ARGS)
