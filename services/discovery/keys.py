"""Where a worker lives in etcd and how its WorkerInfo is written there: the one definition of the key layout.

Key: `/rackserve/v1/workers/{role}/{worker_id}`; value: the `pb.WorkerInfo` as proto3 JSON with the .proto
field names. Readers ignore fields they do not know, so a newer worker can register with an older router.
"""

from __future__ import annotations

from google.protobuf import json_format

from services.rpc import pb

WORKERS_PREFIX = "/rackserve/v1/workers/"
# the planner's seasonal forecast state (what it measured over past days), so a restart does not forget them
PLANNER_SEASON_KEY = "/rackserve/v1/planner/season"
# which planner replica acts (services/discovery/election.py): its worker id, under its registration's lease
PLANNER_LEADER_KEY = "/rackserve/v1/planner/leader"
# the roles WorkerInfo.role may name (see the proto); the planner registers its HTTP endpoint too
ROLES = ("prefill", "decode", "router", "frontend", "planner")


def worker_key(role: str, worker_id: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if not worker_id or "/" in worker_id:
        raise ValueError(f"worker_id must be non-empty and contain no '/', got {worker_id!r}")
    return f"{WORKERS_PREFIX}{role}/{worker_id}"


def split_worker_key(key: str) -> tuple[str, str] | None:
    """(role, worker_id) for a key under WORKERS_PREFIX, None for anything else found there."""
    if not key.startswith(WORKERS_PREFIX):
        return None
    parts = key[len(WORKERS_PREFIX) :].split("/")
    if len(parts) != 2 or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]


def encode_worker_info(info: pb.WorkerInfo) -> bytes:
    return json_format.MessageToJson(
        info, preserving_proto_field_name=True, indent=None, sort_keys=True
    ).encode()


def decode_worker_info(value: bytes) -> pb.WorkerInfo:
    """Raises json_format.ParseError (a ValueError) on a value that is not a WorkerInfo."""
    return json_format.Parse(value.decode(), pb.WorkerInfo(), ignore_unknown_fields=True)
