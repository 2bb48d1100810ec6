"""The generated gRPC code for proto/rackserve/v1, re-exported from one place: `from services.rpc import pb, pb_grpc`.

The code under services/rpc/rackserve/ is produced by `make proto` (grpcio-tools) and never edited or committed.
"""

from __future__ import annotations

try:
    from services.rpc.rackserve.v1 import rackserve_pb2 as pb
    from services.rpc.rackserve.v1 import rackserve_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - a checkout that skipped the build step
    raise ImportError("generated protobuf code is missing: run `make proto` (part of `make setup`)") from e

__all__ = ["pb", "pb_grpc"]
