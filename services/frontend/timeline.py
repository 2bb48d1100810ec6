"""What a finished request leaves behind: its timeline, one request-log line, its spans and phase metrics.

The coordinator timestamps every phase transition of a `RequestState` (docs/design.md); when a request ends,
`RequestObserver.finished` turns that timeline into
- a timeline record (phase start/end/duration, workers, route reason and score terms, transfer bytes, seconds
  and GB/s of the attempt that answered, migrations with the transfer of each attempt they left), kept for the
  last `--timeline-history` requests and served by `GET /v1/requests/{id}/timeline`;
- one JSON line in the request log (`--request-log PATH`; by default the `rackserve.requests` logger on
  stderr). Prompts are never logged unless `--log-prompts` says so, and then only as token ids;
- the frontend's spans: `request` (its span id is the one the workers saw in `traceparent`, so their
  `route`, `prefill` and `kv_transfer` spans are its children), `queue`, `decode`, one `migration` per
  MIGRATING phase; and the phase histograms.

Nothing here runs while a request is in flight: the request path only timestamps.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from services.frontend.request_state import ANONYMOUS_KEY_NAME, Phase, RequestState
from services.telemetry import metrics, tracing

log = logging.getLogger("rackserve.requests")

DEFAULT_TIMELINE_HISTORY = 1000
_RESPONSE_ID_PREFIXES = ("chatcmpl-", "cmpl-")


def timeline_record(
    state: RequestState, endpoint: str, status: int, include_prompt: bool = False
) -> dict[str, Any]:
    """The request's whole story as plain data (JSON-ready): the log line and the endpoint's answer."""
    record: dict[str, Any] = {"event": "request_finished", "endpoint": endpoint, "status": status}
    record.update(state.summary())
    start = state.timeline[0][1]
    end = state.timeline[-1][1]
    phases = []
    for i, (phase, t) in enumerate(state.timeline):
        if phase in (Phase.DONE, Phase.FAILED):
            continue
        until = state.timeline[i + 1][1] if i + 1 < len(state.timeline) else end
        phases.append(
            {
                "phase": phase.value,
                "start_s": round(t - start, 6),
                "end_s": round(until - start, 6),
                "duration_s": round(until - t, 6),
            }
        )
    plan = state.placement
    span_context = tracing.parse_traceparent(state.traceparent)
    record.update(
        {
            "trace_id": f"{span_context.trace_id:032x}" if span_context else None,
            "end_unix_s": round(end, 6),
            "duration_s": round(end - start, 6),
            "phases": phases,
            "workers": {
                "prefill": record.get("prefill_worker"),
                "decode": record.get("decode_worker"),
            },
            "route": {
                "reason": plan.reason if plan is not None else None,
                "score_terms": dict(plan.score_terms) if plan is not None else {},
            },
        }
    )
    if plan is not None and plan.HasField("prefix_pull"):
        pull = plan.prefix_pull
        record["prefix_pull"] = {  # the plan's pull and what came of it (pulled_tokens 0: recomputed)
            "source": pull.source.worker_id,
            "start_block": pull.start_block,
            "blocks": len(pull.block_hashes),
            "pulled_tokens": state.pulled_tokens,
        }
    if include_prompt:
        record["prompt_token_ids"] = list(state.prompt_token_ids)
    return record


class RecentTimelines:
    """The last `capacity` finished requests' records, by our request id (and the client's x-request-id), each
    readable only by its owner: the API key that sent it (`api_key_name`). Client ids are each key's own, so two
    keys that send the same x-request-id each find their own request."""

    def __init__(self, capacity: int = DEFAULT_TIMELINE_HISTORY) -> None:
        self.capacity = max(1, capacity)
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._client_ids: dict[tuple[str, str], str] = {}  # (owner, client id) -> our id

    def add(self, record: dict[str, Any]) -> None:
        rid = record["request_id"]
        self._records[rid] = record
        self._records.move_to_end(rid)
        if record.get("client_request_id"):
            self._client_ids[_client_key(record)] = rid
        while len(self._records) > self.capacity:
            _, old = self._records.popitem(last=False)
            if old.get("client_request_id") and self._client_ids.get(_client_key(old)) == old["request_id"]:
                del self._client_ids[_client_key(old)]

    def get(self, request_id: str, owner: str = ANONYMOUS_KEY_NAME) -> dict[str, Any] | None:
        """`owner`'s request by our id, the response id (`chatcmpl-…`, `cmpl-…`) or its x-request-id; None for
        another key's request, as for an unknown one."""
        ours = request_id
        for prefix in _RESPONSE_ID_PREFIXES:
            if request_id.startswith(prefix) and request_id[len(prefix) :] in self._records:
                ours = request_id[len(prefix) :]
        for rid in (ours, self._client_ids.get((owner, request_id))):
            record = self._records.get(rid) if rid is not None else None
            if record is not None and _owner(record) == owner:
                return record
        return None

    def __len__(self) -> int:
        return len(self._records)


def _owner(record: dict[str, Any]) -> str:
    return str(record.get("api_key_name") or ANONYMOUS_KEY_NAME)


def _client_key(record: dict[str, Any]) -> tuple[str, str]:
    return _owner(record), record["client_request_id"]


class RequestLog:
    """One JSON line per finished request: to `path` (appended) when given, else to the logger."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str)
        if self._file is None:
            log.info(line)
            return
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RequestObserver:
    """The frontend's hook at request end (see the module docstring)."""

    def __init__(
        self, history: int = DEFAULT_TIMELINE_HISTORY, request_log: str = "", log_prompts: bool = False
    ) -> None:
        self.timelines = RecentTimelines(history)
        self.request_log = RequestLog(request_log)
        self.log_prompts = log_prompts

    def finished(
        self,
        endpoint: str,
        state: RequestState,
        status: int,
        error_type: str | None = None,
        refused: bool = False,
    ) -> None:
        """`refused`: turned away before it was taken (429): recorded and traced, but no phase is observed, so
        the phase histograms describe the requests served."""
        record = timeline_record(state, endpoint, status)
        if error_type:
            record["error_type"] = error_type
        self.timelines.add(record)
        self.request_log.write(
            {**record, "prompt_token_ids": list(state.prompt_token_ids)} if self.log_prompts else record
        )
        if not refused:
            _observe_phases(record)
        _emit_spans(state, record)

    def close(self) -> None:
        self.request_log.close()


def _observe_phases(record: dict[str, Any]) -> None:
    for phase in record["phases"]:
        metrics.PHASE_S.labels(phase["phase"]).observe(phase["duration_s"])
    if record["phase"] == Phase.DONE.value:
        metrics.OUTPUT_TOKENS_PER_REQUEST.observe(record["completion_tokens"])


def _emit_spans(state: RequestState, record: dict[str, Any]) -> None:
    """The frontend's spans, built from the timeline after the fact (no span code on the request path)."""
    if not tracing.enabled():
        return
    start, end = record["start_unix_s"], record["end_unix_s"]
    rid = {tracing.REQUEST_ID: state.request_id}
    with tracing.pinned_ids(state.traceparent):
        span = tracing.tracer().start_span(
            "request",
            context=tracing.context_of(state.parent_traceparent),
            kind=tracing.SpanKind.SERVER,
            start_time=tracing.unix_ns(start),
        )
    transfer = record.get("transfer") or {}
    tracing.set_attributes(
        span,
        {
            **rid,
            "rackserve.client_request_id": record.get("client_request_id"),
            "rackserve.endpoint": record["endpoint"],
            "http.response.status_code": record["status"],
            "rackserve.phase": record["phase"],
            "rackserve.finish_reason": record.get("finish_reason"),
            "rackserve.error": record.get("error"),
            "rackserve.prompt_tokens": record["prompt_tokens"],
            "rackserve.completion_tokens": record["completion_tokens"],
            "rackserve.cached_tokens": record["cached_tokens"],
            "rackserve.pulled_tokens": record["pulled_tokens"],
            "rackserve.prefix_pull.source": (record.get("prefix_pull") or {}).get("source"),
            "rackserve.ttft_s": record.get("ttft_s"),
            "rackserve.route.reason": record["route"]["reason"],
            "rackserve.prefill_worker": record["workers"]["prefill"],
            "rackserve.decode_worker": record["workers"]["decode"],
            "rackserve.transfer_bytes": transfer.get("bytes"),
            "rackserve.transfer_backend": transfer.get("backend"),
            "rackserve.migrations": state.migrations,
            **{f"rackserve.phase.{p['phase']}_s": p["duration_s"] for p in record["phases"]},
            **{f"rackserve.route.score.{k}": v for k, v in record["route"]["score_terms"].items()},
        },
    )
    if record["status"] >= 400 or record["phase"] == Phase.FAILED.value:
        span.set_status(tracing.StatusCode.ERROR, record.get("error") or f"HTTP {record['status']}")
    migrations = 0
    for phase in record["phases"]:
        p_start, p_end = start + phase["start_s"], start + phase["end_s"]
        if phase["phase"] == Phase.QUEUED.value:
            tracing.child_span(span, "queue", p_start, p_end, rid)
        elif phase["phase"] == Phase.DECODING.value:
            first_token = state.first_token_unix_s
            tracing.child_span(
                span,
                "decode",
                p_start,
                p_end,
                {
                    **rid,
                    "rackserve.decode_worker": record["workers"]["decode"],
                    "rackserve.tokens": record["completion_tokens"],
                    "rackserve.first_token_unix_s": first_token,
                    "rackserve.last_token_unix_s": end,
                },
            )
        elif phase["phase"] == Phase.MIGRATING.value:
            tracing.child_span(
                span,
                "migration",
                p_start,
                p_end,
                {**rid, "rackserve.migration.cause": _migration_cause(record, migrations),
                 "rackserve.migration.path": str((_nth(record, migrations) or {}).get("path", "")),
                 "rackserve.migration.record": json.dumps(_nth(record, migrations), default=str)},
            )  # fmt: skip
            migrations += 1
    span.end(end_time=tracing.unix_ns(end))


def _nth(record: dict[str, Any], i: int) -> Any:
    records = record.get("migration_log") or []  # the coordinator's Migration.as_dict() per migration
    return records[i] if i < len(records) else None


def _migration_cause(record: dict[str, Any], i: int) -> str:
    """A low-cardinality cause: the record's `cause` up to its first ':' (e.g. "UNAVAILABLE")."""
    nth = _nth(record, i)
    cause = str(nth.get("cause", "")) if isinstance(nth, dict) else ""
    return metrics.reason_label(cause.split(":", 1)[0]) if cause else "unknown"
