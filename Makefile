# deconv: one source of truth for installing, testing and serving (the Dockerfile runs these same targets).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Pins applied on top of pyproject's ranges (torch: the CPU build here; the image passes its own).
CONSTRAINTS ?= constraints.txt
# Extra pip arguments, e.g. an index for a CUDA build of torch in the image.
PIP_ARGS ?=
# Optional extras of the deconv package for `make install`, e.g. EXTRAS=ray (the image's EXTRAS build argument).
EXTRAS ?=
# `make serve` address: HOST=/PORT= on make's command line win, then DECONV_HOST/DECONV_PORT from the environment,
# then PORT from the environment (as platforms that assign a port set it), then the server's 127.0.0.1:8000.
SERVE_HOST := $(if $(filter command line,$(origin HOST)),$(HOST))
SERVE_PORT := $(if $(filter command line,$(origin PORT)),$(PORT),$(if $(DECONV_PORT),,$(PORT)))
# Architectures for `make nvcc-check` (CI compiles every kernel source for these).
NVCC_ARCHS ?= 80 90a

.PHONY: install install-dev test lint format serve nvcc-check kernels bench clean

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(VENV)/.installed: pyproject.toml client/pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c $(CONSTRAINTS) $(PIP_ARGS) -e ".$(if $(EXTRAS),[$(EXTRAS)])" -e ./client
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install --quiet -c $(CONSTRAINTS) $(PIP_ARGS) -e ".[test,bench,ray]" -e "./client[torch]"
	touch $@

test: install-dev
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports  # the import contracts of .importlinter: layers, no cycles, a standalone client
	$(PY) -m pytest -q

lint: install-dev
	$(PY) -m ruff check .

format: install-dev
	$(PY) -m ruff format .

# Runs in the caller's directory (also under make -C), so that relative DECONV_* paths resolve from there. Every other
# setting is the server's own default unless exported: DECONV_HTTP_PROCESSES=auto sizes the HTTP processes from the
# cores and GPUs (docs/operations.md, "Several HTTP processes").
serve: install
	cd "$(or $(PWD),$(CURDIR))" && $(abspath $(VENV))/bin/deconv-serve$(if $(SERVE_HOST), --host $(SERVE_HOST))$(if $(SERVE_PORT), --port $(SERVE_PORT))

# Compile every kernel source with nvcc alone (no torch headers), keeping ptxas' register/spill report.
nvcc-check:
	@command -v nvcc >/dev/null || { echo "nvcc not found: the CUDA toolkit is needed for nvcc-check"; exit 1; }
	@set -e; for f in kernels/csrc/*.cu; do \
	  for a in $(NVCC_ARCHS); do \
	    echo "== nvcc $$f sm_$$a"; \
	    nvcc -std=c++17 -O3 -Ikernels/csrc -gencode arch=compute_$$a,code=sm_$$a -Xptxas -v \
	      -c $$f -o /tmp/deconv-nvcc-check-$$a.o 2>&1; \
	  done; \
	done

# Build the CUDA kernels into the build cache now (needs a CUDA build of torch; DECONV_CUDA_ARCH without a GPU).
kernels: install
	$(PY) -m kernels.build

bench: install-dev
	$(PY) -m bench.kernels.kernelbench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info client/*.egg-info
