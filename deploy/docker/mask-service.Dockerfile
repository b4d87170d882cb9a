# syntax=docker/dockerfile:1.7
# CPU grammar-mask service: no CUDA, no triton, no Ray.
#   docker build -f deploy/docker/mask-service.Dockerfile -t specmask/mask-service:0.1.0 .
# Base images are pinned to exact tags; pin digests at release time with
#   docker buildx imagetools inspect python:3.12.12-slim-bookworm
# and build with --build-arg PYTHON_IMAGE=python:3.12.12-slim-bookworm@sha256:...
# Python 3.12 in every image: the orchestrator's Ray client must match the
# Ray cluster's Python minor version (the GPU image is Ubuntu 24.04 = 3.12).
ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/docker/requirements/mask-service.txt /tmp/requirements.txt
# Fully pinned closure (deploy/docker/lock.py); torch is the +cpu build.
RUN pip install --no-deps -r /tmp/requirements.txt
# xgrammar's wheel metadata requires torch, transformers and triton. `import
# xgrammar` really imports torch (xgrammar/matcher.py) and transformers
# (xgrammar/tokenizer_info.py) but never triton, so: --no-deps, with CPU torch
# and transformers already installed above (deploy/README.md, "xgrammar and torch").
RUN pip install --no-deps xgrammar==0.2.8
RUN pip install setuptools==84.2.1 wheel==0.45.1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specmask ./specmask
RUN pip install --no-deps --no-build-isolation . \
 && pip uninstall -y setuptools wheel \
 && specmask mask-service --help > /dev/null \
 && python -c "import xgrammar, grpc_health.v1, grpc_reflection.v1alpha"
COPY deploy/healthcheck.py /opt/venv/bin/grpc-healthcheck

FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
COPY --from=build /opt/venv /opt/venv
RUN groupadd --system --gid 10001 specmask \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp specmask
USER 10001:10001
WORKDIR /tmp
# 50051 gRPC (mask service + grpc.health.v1 + reflection); 9091 Prometheus (optional).
EXPOSE 50051 9091
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "/opt/venv/bin/grpc-healthcheck", "--address", "127.0.0.1:50051"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["specmask", "mask-service"]
# All interfaces: the container is reached on its own IP, never on loopback.
CMD ["--host", "0.0.0.0", "--port", "50051"]
