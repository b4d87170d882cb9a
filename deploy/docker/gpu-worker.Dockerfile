# syntax=docker/dockerfile:1.7
# GPU worker / Ray node image: the KubeRay head and GPU worker pods run it.
#   docker build -f deploy/docker/gpu-worker.Dockerfile -t specmask/gpu-worker:0.1.0 .
# specmask is installed so the GpuWorker Ray actor (specmask.gpu_worker.actor) is
# importable on every node; the models come from a read-only volume.
# torch 2.13.0 from PyPI is a CUDA 13 build that ships its own CUDA runtime
# libraries (nvidia-* wheels), so the base only needs the driver-facing CUDA
# environment: the small `base` flavour (needs a host driver >= 580).
# Pin digests at release time: docker buildx imagetools inspect <image>.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 DEBIAN_FRONTEND=noninteractive
# Ubuntu 24.04's Python is 3.12, the same minor as the CPU images (Ray client
# and cluster must agree on it).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/docker/requirements/gpu-worker.txt /tmp/requirements.txt
# Not --no-deps: torch resolves its exactly-pinned nvidia-* and triton wheels,
# ray[default] its dashboard extras; everything else is pinned in the file.
RUN pip install -r /tmp/requirements.txt
RUN pip install --no-deps xgrammar==0.2.8
RUN pip install setuptools==84.2.1 wheel==0.45.1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specmask ./specmask
RUN pip install --no-deps --no-build-isolation . \
 && pip uninstall -y setuptools wheel \
 && specmask --help > /dev/null \
 && python -c "import specmask.gpu_worker, specmask.kernels, ray, torch, triton, xgrammar"

FROM ${CUDA_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# wget: KubeRay's default head/worker probes call the Ray agent over HTTP with it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 wget \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
# KubeRay starts Ray with `/bin/bash -lc 'ray start ...'`: a login shell, whose
# profile may reset PATH; keep the venv on it.
RUN echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/specmask-venv.sh
# GRPC_ENABLE_FORK_SUPPORT=false: the Ray client server (head) forks its
# per-client servers while gRPC threads run; with fork support on, the child runs
# gRPC's fork handlers and can die at start (specmask/proto/__init__.py has the story).
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/ray HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRPC_ENABLE_FORK_SUPPORT=false
RUN groupadd --system --gid 10001 ray \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/ray ray
USER 10001:10001
WORKDIR /home/ray
# 6379 GCS, 8265 dashboard, 10001 Ray client server, 8080 metrics.
EXPOSE 6379 8265 10001 8080
# KubeRay replaces the command with its own `ray start ...` and adds probes;
# this default runs a standalone head, e.g. for `docker run --gpus all`.
HEALTHCHECK NONE
ENTRYPOINT []
CMD ["ray", "start", "--head", "--block", "--dashboard-host=0.0.0.0", "--port=6379", "--ray-client-server-port=10001"]
