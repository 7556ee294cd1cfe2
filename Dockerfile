# syntax=docker/dockerfile:1
# deconv: the inference service on its CUDA kernels. Installs with the Makefile's own targets (`make install`,
# `make kernels`), so the image, CI and a developer's machine install the same way. docs/deploy.md has the commands.
#
#   docker build -t deconv .                                   # CUDA 13.0 devel base, torch 2.13.0 from PyPI (cu130)
#   docker build -t deconv --build-arg CUDA_ARCHS="8.0;8.6;8.9;9.0" .
#   docker build -t deconv:cu128 --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04 \
#       --build-arg TORCH_SPEC="torch==2.13.0+cu128" \
#       --build-arg PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cu128" .
#   docker build -t deconv:cpu --build-arg BASE_IMAGE=ubuntu:24.04 --build-arg CUDA_ARCHS= \
#       --build-arg TORCH_SPEC="torch==2.13.0+cpu" \
#       --build-arg PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu" .

# A *devel* image: the kernels are built by torch's load_inline, which needs nvcc; and the build cache key holds
# nvcc's version, so nvcc stays in the running image too. Its CUDA major must be the one torch was built with
# (torch 2.13.0 on PyPI: CUDA 13.0).
ARG BASE_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
FROM ${BASE_IMAGE}

# The torch requirement that replaces constraints.txt's CPU pin, and extra pip arguments (a CUDA wheel index).
ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_ARGS=""
# Architectures the kernels are compiled for at build time (no GPU needed); empty: no kernels (a CPU image).
ARG CUDA_ARCHS="8.0;9.0"
# Optional extras of the deconv package, e.g. "ray" for a Ray / KubeRay image (needs the Makefile's EXTRAS).
ARG EXTRAS=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# python3-dev: torch extensions include Python.h; g++ and ninja: load_inline's build; wget: KubeRay's probes.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev make g++ ninja-build ca-certificates wget \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/deconv --shell /bin/bash deconv \
 && mkdir -p /opt/deconv/kernel-cache \
 && chown deconv:deconv /opt/deconv/kernel-cache

WORKDIR /opt/deconv/app

# --- 1. dependencies: only what `make install` reads, so that a source change does not reinstall them ----------
# The Makefile installs the project editable (-e . -e ./client). An editable install records where each top-level
# package lives, so empty stand-ins for the three packages (and for the README that pyproject names) let it run
# now; `COPY . .` below puts the real files at the same paths, and the installed project then imports them.
# The image's constraints: constraints.txt with its torch pin replaced by TORCH_SPEC.
COPY Makefile pyproject.toml constraints.txt ./
COPY client/pyproject.toml client/
RUN mkdir -p kernels service client/deconv_client \
 && touch README.md kernels/__init__.py service/__init__.py client/deconv_client/__init__.py \
 && { grep -v -E '^torch([^A-Za-z0-9_.-]|$)' constraints.txt || true; } > /opt/deconv/constraints.txt \
 && echo "${TORCH_SPEC}" >> /opt/deconv/constraints.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ -n "${EXTRAS}" ] && ! grep -q 'EXTRAS' Makefile; then \
      echo "EXTRAS=${EXTRAS} given, but the Makefile's install target does not take EXTRAS" >&2; exit 1; \
    fi \
 && make install VENV=/opt/deconv/venv CONSTRAINTS=/opt/deconv/constraints.txt PIP_ARGS="${PIP_ARGS}" \
      EXTRAS="${EXTRAS}" PYTHON=python3

# --- 2. the source, and the kernels compiled into the image's build cache --------------------------------------
COPY . .
ENV PATH=/opt/deconv/venv/bin:${PATH} \
    DECONV_KERNEL_CACHE=/opt/deconv/kernel-cache \
    DECONV_CUDA_ARCH=${CUDA_ARCHS} \
    DECONV_HOST=0.0.0.0 \
    DECONV_PORT=8000
# Compiled as the user that runs the service: the cache stays its own (torch takes a lock file in it at load).
# DECONV_CUDA_ARCH stays set at run time, so the cache key matches and a container loads instead of compiling.
# `-o .../.installed`: step 1 installed the project already; make must not redo it for the newer source files.
USER deconv
RUN if [ -n "${CUDA_ARCHS}" ]; then \
      DECONV_CUDA_ARCH="${CUDA_ARCHS}" make -o /opt/deconv/venv/.installed kernels \
        VENV=/opt/deconv/venv CONSTRAINTS=/opt/deconv/constraints.txt PIP_ARGS="${PIP_ARGS}"; \
    else \
      echo "CUDA_ARCHS is empty: no kernels in this image (CPU only)"; \
    fi

EXPOSE 8000
STOPSIGNAL SIGTERM
# 200 only once every layer passed its self-test; a cold kernel build (empty cache) takes two to five minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=420s --retries=3 \
    CMD ["python", "/opt/deconv/app/deploy/healthcheck.py"]
CMD ["python", "-m", "service"]
