"""Grammar compiles off the event loop (services.engine.structured.Grammars.compile_within) when some are costly."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest

from services.engine import structured
from services.engine.structured import GrammarError, Grammars
from services.engine.tokenizer import Tokenizer


def costly(depth: int) -> str:
    """A JSON schema whose grammar takes seconds to compile (nested bounded repeats; ~3 s at 4 here)."""
    return json.dumps({"type": "string", "pattern": f"(([a-z]{{0,4}}){{0,4}}){{0,{depth}}}"})


def test_costly_compiles_holding_every_thread_hold_up_no_grammar_compiled_before(gguf_path: str) -> None:
    """Two costly schemas took both compile threads; every later json_object request was refused for as long as
    they ran, and each refused request left a compile queued that ran later anyway (the security audit, until
    2026-12-07). Now a grammar compiled before needs no thread; requests for one grammar share one compile (one
    that gives up does not take it from another still waiting); a compile nobody waits for any more never runs."""
    tok = Tokenizer.from_gguf(gguf_path)
    g = Grammars(tok, tok.vocab_size, tok.stop_token_ids)
    compiles: Counter[tuple[str, str]] = Counter()
    real = g._compiled

    def counted(kind: str, spec: str) -> Any:
        compiles[kind, spec] += 1
        return real(kind, spec)

    g._compiled = counted  # type: ignore[method-assign]

    async def body() -> list[Any]:
        await g.compile_within("json_object", "", 30.0)  # compiled once, early
        held = [g.compile_within("json_schema", costly(d), 0.3) for d in (4, 5)]
        refused = await asyncio.gather(*held, return_exceptions=True)  # both still compiling
        await g.compile_within("json_object", "", 0.3)  # both threads busy: passes anyway
        with pytest.raises(GrammarError, match="did not compile within 0.3 s"):
            await g.compile_within("regex", "[0-9]+", 0.3)  # queued behind them, and given up on
        impatient = g.compile_within("regex", "[a-z]+", 0.3)
        patient = g.compile_within("regex", "[a-z]+", 60.0)
        shared = await asyncio.gather(impatient, patient, return_exceptions=True)
        await asyncio.gather(*[g.compile_within("regex", "[b-y]+", 60.0) for _ in range(3)])  # one compile
        await g.compile_within("json_schema", costly(4), 60.0)  # compiled already: not again
        assert compiles["regex", "[0-9]+"] == 0  # given up before it started: never ran
        await g.compile_within("regex", "[0-9]+", 60.0)  # asked again: compiled now
        return [*refused, *shared]

    refused_a, refused_b, impatient, patient = asyncio.run(body())
    assert all(isinstance(e, GrammarError) for e in (refused_a, refused_b, impatient))
    assert patient is None  # the one still waiting got its grammar
    assert compiles["json_schema", costly(4)] == 1 and compiles["regex", "[a-z]+"] == 1
    assert compiles["regex", "[0-9]+"] == 1 and compiles["regex", "[b-y]+"] == 1


@pytest.mark.parametrize(
    ("kind", "spec", "says"),
    [
        ("regex", "((", "Regex parsing error at position 3: The parenthesis is not closed."),
        ("grammar", "root ::= x", 'EBNF parser error at line 1, column 10: Rule "x" is not defined'),
    ],
)
def test_a_grammar_that_does_not_compile_says_why_without_the_librarys_source_paths(
    gguf_path: str, kind: str, spec: str, says: str
) -> None:
    """The 400 a client gets says what is wrong with its grammar; xgrammar's log prefix (a time and the path of
    its own C++ source file, in every message until 2026-12-07) is not part of it."""
    tok = Tokenizer.from_gguf(gguf_path)
    g = Grammars(tok, tok.vocab_size, tok.stop_token_ids)
    with pytest.raises(GrammarError) as e:
        asyncio.run(g.compile_within(kind, spec, 30.0))
    assert str(e.value) == f"the {kind} grammar does not compile: {says}"


def test_compiled_grammars_kept_for_later_requests_stay_within_the_cache_limit(
    gguf_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every distinct grammar a client sent stayed compiled in xgrammar's unbounded cache: a 40 KB regex holds
    127 MB, so a handful of requests grew a frontend (and every worker they reached) by gigabytes for good (the
    security audit, until 2026-12-07). Now the grammars kept are the last used, within CACHE_LIMIT_BYTES; one
    dropped still opens a matcher (compiled again) and the newest is always kept."""
    monkeypatch.setattr(structured, "CACHE_LIMIT_BYTES", 20 << 20, raising=False)
    tok = Tokenizer.from_gguf(gguf_path)
    g = Grammars(tok, tok.vocab_size, tok.stop_token_ids)
    # each about 8 MB compiled: 6 of them twice the limit
    specs = [f"x{i}" + "(a|b)" * 2000 for i in range(6)]

    async def body() -> None:
        for spec in specs:
            await g.compile_within("regex", spec, 60.0)

    asyncio.run(body())
    # what xgrammar's cache holds and what Grammars keeps itself
    kept = sum(size for _, size in g._ready.values()) if isinstance(g._ready, dict) else 0
    held = g._compiler.get_cache_size_bytes() + kept
    assert held <= 20 << 20, f"{held >> 20} MB of compiled grammars held"
    assert ("regex", specs[-1]) in g._ready
    m = g.matcher("regex", specs[0])  # dropped: compiled again for its matcher
    assert all(m.accept(t) for t in tok.encode("x0ab"))
