"""The frontend's traffic log: which earlier request each prompt shares a prefix with, and how much of it."""

from __future__ import annotations

import random

from services.telemetry.traffic import SHARE_TOKENS, TrafficLog


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def test_a_prompt_names_the_request_it_shares_its_longest_prefix_with_and_how_many_tokens() -> None:
    log = TrafficLog()
    a = _tokens(3 * SHARE_TOKENS + 50, 1)
    b = a[: 2 * SHARE_TOKENS + 10] + _tokens(400, 2)  # shares two whole prefixes and a little of the third
    ra = log.admit(a, now=100.0)
    rb = log.admit(b, now=101.0)
    rc = log.admit(_tokens(900, 3), now=102.0)
    assert (ra.parent, ra.shared_tokens) == (None, 0)
    assert (rb.parent, rb.shared_tokens) == (ra.seq, 2 * SHARE_TOKENS)
    assert (rc.parent, rc.shared_tokens) == (None, 0)
    # a's whole prompt again: b holds its first two prefixes too, but only a holds all three
    again = log.admit(a, now=103.0)
    assert (again.parent, again.shared_tokens) == (ra.seq, 3 * SHARE_TOKENS)
    # the latest holder is named: a fourth copy's parent is the third
    assert log.admit(a, now=104.0).parent == again.seq
    assert [r.seq for r in log.since(rb.seq, now=104.0)] == [rc.seq, again.seq, again.seq + 1]
    assert [r.prompt_tokens for r in log.since(0, now=104.0)][:3] == [len(a), len(b), 900]


def test_records_older_than_the_log_keeps_are_gone_and_share_nothing_any_more() -> None:
    log = TrafficLog(keep_s=60.0)
    a = _tokens(2 * SHARE_TOKENS, 4)
    first = log.admit(a, now=0.0)
    assert log.admit(a, now=30.0).parent == first.seq
    later = log.admit(_tokens(10, 5), now=70.0)  # first (t=0) has expired, the copy at 30 s has not
    assert [r.t for r in log.since(0, now=70.0)] == [30.0, 70.0]
    assert log.admit(a, now=85.0).parent == later.seq - 1  # the copy at 30 s, held until 90 s
    assert log.admit(a, now=150.0).parent is None  # every copy has expired (the last at 145 s)
