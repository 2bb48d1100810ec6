"""A request's state in the frontend (docs/design.md, "State map"): what must outlive every worker serving it.

`RequestState` holds the prompt tokens, the sampling params (always with a concrete seed, so a replay on another
worker draws the same tokens), the tokens emitted so far with the client's cursor into them, and the phase, with
a timestamp per transition — the request's trace:

    QUEUED → ROUTED → PREFILLING → TRANSFERRING → DECODING → DONE
                          └────────────┴─────────────┴──→ MIGRATING → ROUTED …   (any of the three → FAILED)

`ALLOWED_TRANSITIONS` is that picture as data; `advance` refuses any other move. Each move of the request to
another worker is a `Migration` record (cause, path, from/to worker, times) in `migration_log`: the data the
trace, the metrics and the request's log line (`summary`) are built from.

This room holds state and its transitions only: it makes no call, and deals in token ids, never text.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.frontend.errors import timed_out
from services.rpc import pb
from services.telemetry import metrics


class Phase(enum.Enum):
    QUEUED = "queued"
    ROUTED = "routed"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    MIGRATING = "migrating"
    DONE = "done"
    FAILED = "failed"


_MIDDLE = {Phase.MIGRATING, Phase.FAILED}

# whose request it is when the API has no keys (auth.ANONYMOUS): every caller is this one
ANONYMOUS_KEY_NAME = "anonymous"

ALLOWED_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.ROUTED, Phase.FAILED}),
    Phase.ROUTED: frozenset({Phase.PREFILLING, Phase.TRANSFERRING, Phase.DECODING, Phase.FAILED}),
    # The first token may already end the request (DONE straight from prefill).
    Phase.PREFILLING: frozenset({Phase.TRANSFERRING, Phase.DECODING, Phase.DONE} | _MIDDLE),
    Phase.TRANSFERRING: frozenset({Phase.DECODING} | _MIDDLE),
    Phase.DECODING: frozenset({Phase.DONE} | _MIDDLE),
    Phase.MIGRATING: frozenset({Phase.ROUTED, Phase.FAILED}),
    Phase.DONE: frozenset(),
    Phase.FAILED: frozenset(),
}


@dataclass
class EmittedToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokenBatch:
    """Tokens that arrived together; `finish_reason` is set on the last batch of a finished request."""

    tokens: list[EmittedToken]
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class Migration:
    """One move of a request to another worker: why, how, where from and to, and how long it took."""

    cause: str  # decode_failed | decode_stalled | prefill_failed | prefill_stalled | transfer_failed
    detail: str  # the failure as the coordinator saw it (status and message)
    from_worker_id: str
    from_role: str  # prefill | decode
    at_token: int  # tokens emitted when it broke; the resumed worker continues at this index
    start_unix_s: float
    path: str = ""  # re-transfer (the prefill copy of the KV) | rebuild (prefill again)
    to_worker_id: str = ""
    end_unix_s: float | None = None  # when the first token (or chunk) of the new attempt arrived
    outcome: str = ""  # resumed | failed
    # the KV pull of the attempt this migration left (RequestState.transfer_record), None where it made none;
    # the attempt that answered has its own in the request's `transfer`
    transfer: dict[str, object] | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.end_unix_s is None else self.end_unix_s - self.start_unix_s

    def as_dict(self) -> dict[str, object]:
        return {
            "cause": self.cause,
            "path": self.path,
            "from": self.from_worker_id,
            "to": self.to_worker_id,
            "at_token": self.at_token,
            "outcome": self.outcome,
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 6),
            "transfer": self.transfer,
        }


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: pb.SamplingParams  # `seed` is always concrete
    traceparent: str
    deadline_s: float  # time.monotonic() past which the request has timed out
    emitted: list[EmittedToken] = field(default_factory=list)
    client_cursor: int = 0  # emitted[:client_cursor] has been handed to the client
    phase: Phase = Phase.QUEUED
    timeline: list[tuple[Phase, float]] = field(default_factory=list)  # (phase, unix time s) per transition
    plan: pb.RoutePlan | None = None  # the current attempt's
    # the router's placement of the request (its first plan: a migration's plan only replaces a worker, and the
    # migration log says which), and the prefill worker that ran its prompt, whichever attempt it was
    placement: pb.RoutePlan | None = None
    prefill_worker: str | None = None
    failed_worker_ids: list[str] = field(default_factory=list)
    migrations: int = 0
    cached_tokens: int = 0
    pulled_tokens: int = 0  # of cached_tokens: those whose KV the prefilling worker pulled from a peer
    finish_reason: str | None = None
    stop_reason: str | None = None
    error: str | None = None
    client_request_id: str | None = None  # the client's x-request-id, for finding its log line
    api_key_name: str = ANONYMOUS_KEY_NAME  # the API key that sent it (auth.Principal): whose timeline it is
    first_token_unix_s: float | None = None  # when the first token reached the coordinator
    # the current attempt's KV transfer, as its decode worker reported it (a migration moves it to its record)
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    transfer_backend: str | None = None
    parent_traceparent: str | None = None  # the client's traceparent, the parent of our `request` span
    migration_log: list[Migration] = field(default_factory=list)  # one entry per migration, in order
    held_kv: pb.KvHandle | None = None  # the prompt's KV a prefill worker holds for this request
    hold_ttl_s: float = 0.0  # how long the prefill worker holds it per grant (what ExtendHold asks for)
    decode_queue_s: float = 0.0  # seconds in decode workers' queues (waiting for KV blocks), all attempts

    def __post_init__(self) -> None:
        if not self.timeline:
            self.timeline.append((self.phase, time.time()))

    def advance(self, phase: Phase) -> None:
        if phase not in ALLOWED_TRANSITIONS[self.phase]:
            raise RuntimeError(f"request {self.request_id}: no transition {self.phase.name} → {phase.name}")
        self.phase = phase
        self.timeline.append((phase, time.time()))

    def finish(self, finish_reason: str, stop_reason: str | None = None) -> None:
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self.advance(Phase.DONE)

    def fail(self, error: str) -> None:
        if self.phase not in (Phase.DONE, Phase.FAILED):
            self.error = error
            self.advance(Phase.FAILED)

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.DONE, Phase.FAILED)

    def take_unseen(self) -> list[EmittedToken]:
        """Tokens the client has not been given yet; moves the cursor past them."""
        new = self.emitted[self.client_cursor :]
        self.client_cursor = len(self.emitted)
        return new

    def remaining_s(self) -> float:
        """Seconds left before the deadline; raises the 504 once there are none."""
        left = self.deadline_s - time.monotonic()
        if left <= 0:
            raise timed_out(f"request {self.request_id} ran past its deadline")
        return left

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-request-id", self.request_id), ("traceparent", self.traceparent))

    def time_of(self, phase: Phase) -> float | None:
        return next((t for p, t in self.timeline if p is phase), None)

    @property
    def ttft_s(self) -> float | None:
        first = self.first_token_unix_s or self.time_of(Phase.DECODING)
        return None if first is None else first - self.timeline[0][1]

    def first_token_arrived(self) -> None:
        if self.first_token_unix_s is None:
            self.first_token_unix_s = time.time()
            if (ttft := self.ttft_s) is not None:
                metrics.TTFT_S.observe(ttft)

    def migration_ended(self, outcome: str) -> None:
        """Close the open migration record (if any) as `outcome` (resumed | failed) and count it."""
        if not self.migration_log or self.migration_log[-1].outcome:
            return
        m = self.migration_log[-1]
        m.outcome, m.end_unix_s = outcome, time.time()
        metrics.MIGRATIONS.labels(m.cause, m.path or "none", outcome).inc()
        if outcome == "resumed" and m.recovery_s is not None:
            metrics.MIGRATION_RECOVERY_S.labels(m.path).observe(m.recovery_s)

    def transfer_record(self) -> dict[str, object] | None:
        """The current attempt's KV transfer as the log line and timeline show it; None where it pulled none."""
        if not self.transfer_backend:
            return None
        return {
            "bytes": self.transfer_bytes,
            "s": round(self.transfer_s, 6),
            "backend": self.transfer_backend,
            "gb_per_s": round(self.transfer_bytes / self.transfer_s / 1e9, 6)
            if self.transfer_s > 0
            else None,
        }

    def take_transfer(self) -> dict[str, object] | None:
        """The attempt's transfer_record, cleared for the next attempt (a migration keeps it in its record): the
        request's own figures are those of the attempt that answered, not of one that broke."""
        record = self.transfer_record()
        self.transfer_bytes, self.transfer_s, self.transfer_backend = 0, 0.0, None
        return record

    def summary(self) -> dict[str, object]:
        """The one log line per finished request (docs/design.md, "Observability")."""
        start = self.timeline[0][1]
        return {
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "api_key_name": self.api_key_name,
            "traceparent": self.traceparent,
            "phase": self.phase.value,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": len(self.emitted),
            "cached_tokens": self.cached_tokens,
            "pulled_tokens": self.pulled_tokens,
            "decode_worker": self.plan.decode.worker_id if self.plan is not None else None,
            "prefill_worker": self.prefill_worker,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "transfer": self.transfer_record(),
            "route_reason": self.placement.reason if self.placement is not None else None,
            "decode_queue_s": round(self.decode_queue_s, 6),
            "migrations": self.migrations,
            "migration_log": [m.as_dict() for m in self.migration_log],
            "timeline_s": [[p.value, round(t - start, 6)] for p, t in self.timeline],
            "start_unix_s": round(start, 6),
        }


def emitted_token(token: pb.Token) -> EmittedToken:
    """A worker's token as the request keeps it."""
    if not token.has_logprob:
        return EmittedToken(token.token_id)
    top = [(t.token_id, t.logprob) for t in token.top_logprobs]
    return EmittedToken(token.token_id, token.logprob, top)
