"""The recent requests' shapes, for a replay of the traffic itself: when each arrived, its prompt length, and
which earlier request its prompt shares a prefix with, and how long that prefix is.

The frontend admits every request into a `TrafficLog` and serves what it holds at `GET /traffic`; the planner
(`--replay-from recent`) reads it and replays those requests, their prefixes shared as they were, through each
candidate split (`services/planner/plan.py: recent_specs`). No prompt text and no hash leaves the frontend: a
record is a sequence number, a time, a length, and a (parent, shared tokens) pair.

Sharing is found on prefixes of `SHARE_TOKENS` tokens, by chained block hashes (`services.engine.block_hash`):
two prompts whose k-th hashes are equal share their first k x `SHARE_TOKENS` tokens. A record's parent is the
latest request still held that has the longest such prefix of it. Coarser than the engine's KV blocks on
purpose: a 32 k-token prompt is 125 hashes, and a log of a minute of heavy traffic stays a few MiB.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from services.engine.block_hash import block_hashes

SHARE_TOKENS = 256  # the granularity at which shared prefixes are found and reported
KEEP_S = 120.0  # how long a record is held (the planner's replays cover tens of seconds)
MAX_RECORDS = 20_000


@dataclass(frozen=True)
class TrafficRecord:
    seq: int  # this log's own numbering, from 1, in arrival order
    t: float  # arrival, unix seconds
    prompt_tokens: int
    parent: int | None  # the seq of the request it shares a prefix with (None: none held)
    shared_tokens: int  # how many of its first tokens it shares with that one (a multiple of SHARE_TOKENS)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class TrafficLog:
    """Records of the requests admitted in the last `keep_s` seconds (at most `max_records`), thread-safe."""

    def __init__(self, keep_s: float = KEEP_S, max_records: int = MAX_RECORDS) -> None:
        self.keep_s = keep_s
        self.max_records = max_records
        self._records: deque[tuple[TrafficRecord, list[int]]] = deque()  # each with its prefixes' hashes
        self._holder: dict[int, int] = {}  # prefix hash -> the latest held record's seq that has it
        self._seq = 0
        self._lock = threading.Lock()

    def admit(self, token_ids: Sequence[int], now: float | None = None) -> TrafficRecord:
        return self.admit_chain(len(token_ids), block_hashes(token_ids, SHARE_TOKENS), now)

    def admit_chain(
        self, prompt_tokens: int, chain: Sequence[int], now: float | None = None
    ) -> TrafficRecord:
        """Admit a prompt given the chained hashes of its `SHARE_TOKENS`-token prefixes."""
        t = time.time() if now is None else now
        with self._lock:
            self._expire(t)
            shared = 0
            while shared < len(chain) and chain[shared] in self._holder:
                shared += 1
            parent = self._holder[chain[shared - 1]] if shared else None
            self._seq += 1
            for h in chain:
                self._holder[h] = self._seq
            record = TrafficRecord(self._seq, t, prompt_tokens, parent, shared * SHARE_TOKENS)
            self._records.append((record, list(chain)))
            return record

    def since(self, seq: int, now: float | None = None) -> list[TrafficRecord]:
        """The records held with a seq above `seq`, oldest first."""
        with self._lock:
            self._expire(time.time() if now is None else now)
            return [r for r, _ in self._records if r.seq > seq]

    @property
    def last(self) -> int:
        return self._seq

    def _expire(self, now: float) -> None:
        while self._records and (
            len(self._records) > self.max_records or self._records[0][0].t < now - self.keep_s
        ):
            record, chain = self._records.popleft()
            for h in chain:
                if self._holder.get(h) == record.seq:
                    del self._holder[h]
