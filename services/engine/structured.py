"""Constrained decoding with xgrammar: a request's grammar (JSON schema, any JSON object, regex, a choice of
strings, or EBNF) becomes a matcher whose packed bitmask of allowed next tokens the batched sampler applies.

The matcher's state is a function of the tokens emitted so far, so a request resumed elsewhere rebuilds it by
replaying its emitted tokens — the recovery contract holds for constrained requests too. xgrammar is
imported only when a request asks for a grammar.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# A grammar that takes longer to compile is refused. A schema can be made to compile for minutes
# ('(([a-z]{0,30}){0,30}){0,30}' ran for over 280 s), and a compile cannot be stopped: done on a worker's engine
# thread or the frontend's event loop, it froze every request there (until 2026-12-07). `compile_within` runs
# it on a thread of its own, at most COMPILE_THREADS at once.
COMPILE_TIMEOUT_S = 10.0
COMPILE_THREADS = 2
# Compiled grammars kept for later requests, least recently used dropped first past this many bytes together.
# xgrammar's own cache has no bound: every distinct grammar a client sent stayed in memory for good (a 40 KB
# regex such as '(a|b)' * 8000 compiles to 127 MB; until 2026-12-07 a few requests grew a frontend by gigabytes).
CACHE_LIMIT_BYTES = 256 << 20


# xgrammar's messages start with its log prefix: "[14:43:36] /project/cpp/regex_converter.cc:94: " — the time and
# the library's own source file, nothing a client can act on (and none of its business)
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:.]+\]\s+\S+:\d+:\s*")


def _client_message(e: Exception) -> str:
    """What a compile error says, without the library's log prefix."""
    return _XGRAMMAR_PREFIX.sub("", str(e)).strip()


class GrammarError(ValueError):
    """The grammar does not compile (a bad schema, regex or EBNF)."""


@dataclass
class _Compile:
    """One compile asked for: its job, how many requests wait for it, and whether it started or never will."""

    job: asyncio.Future[None] = field(init=False)  # set as soon as it is made
    waiters: int = 0
    started: bool = False  # (these two under Grammars._lock: the compile thread reads and sets them)
    abandoned: bool = False


class Grammars:
    """Compiles grammars for one tokenizer (the last ones used kept, up to CACHE_LIMIT_BYTES) and opens matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        # the compiler is built once, whichever thread asks; guards what follows
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # compiled, least recently used first, with their sizes (under _lock)
        self._ready: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._ready_bytes = 0
        # the compiles asked for and not ended (loop thread)
        self._running: dict[tuple[str, str], _Compile] = {}

    async def compile_within(self, kind: str, spec: str, timeout_s: float | None = None) -> None:
        """Compile (kind, spec) off the calling thread, so that `matcher` then finds it kept;
        GrammarError if it does not compile, or not within `timeout_s` (the compile goes on in its thread, and
        holds one of COMPILE_THREADS until it ends; a request waiting for a thread waits within the same
        deadline). A grammar compiled before needs no thread (costly compiles running cannot hold it up); a
        request for one asked for already waits for that compile, never a second; a compile that every request
        asking for it has given up on before it started is never run."""
        key = (kind, spec)
        with self._lock:
            if key in self._ready:
                self._ready.move_to_end(key)
                return
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, "grammar-compile")
        c = self._running.get(key)
        if c is None:
            c = self._running[key] = _Compile()
            c.job = asyncio.get_running_loop().run_in_executor(self._pool, self._run, key, c)
            # its error is ours, or nobody's
            c.job.add_done_callback(lambda f: f.cancelled() or f.exception())
            c.job.add_done_callback(lambda _: self._running.pop(key) if self._running.get(key) is c else None)
        c.waiters += 1
        timeout_s = COMPILE_TIMEOUT_S if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(c.job)  # the compile cannot be stopped; only the wait for it ends
        except TimeoutError:
            raise GrammarError(
                f"the {kind} grammar did not compile within {timeout_s:g} s (too costly; simplify it)"
            ) from None
        finally:
            c.waiters -= 1
            if not c.waiters and not c.job.done():
                with self._lock:
                    c.abandoned = not c.started  # still queued: it never starts (a later request asks anew)
                if c.abandoned and self._running.get(key) is c:
                    del self._running[key]

    def _run(self, key: tuple[str, str], c: _Compile) -> None:
        with self._lock:
            if c.abandoned:  # queued behind costly compiles until every request for it gave up
                raise GrammarError(f"the {key[0]} grammar waited for a compile thread past its deadline")
            c.started = True
        self._keep(key, self._compiled(*key))

    def _keep(self, key: tuple[str, str], compiled: Any) -> None:
        """Keep a compiled grammar, dropping the least recently used past CACHE_LIMIT_BYTES (never the newest:
        its request opens a matcher from it next; a matcher holds its grammar however long it runs)."""
        size = compiled.memory_size_bytes
        with self._lock:
            old = self._ready.pop(key, None)
            self._ready_bytes += size - (old[1] if old else 0)
            self._ready[key] = (compiled, size)
            while self._ready_bytes > CACHE_LIMIT_BYTES and len(self._ready) > 1:
                _, (_, dropped) = self._ready.popitem(last=False)
                self._ready_bytes -= dropped

    def _compiled(self, kind: str, spec: str) -> Any:
        try:
            return self._compile(kind, spec)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError for a bad schema, regex or EBNF
            raise GrammarError(f"the {kind} grammar does not compile: {_client_message(e)}") from e

    def _compile(self, kind: str, spec: str) -> Any:
        import xgrammar as xgr

        if kind not in KINDS:  # before the compiler is built (a second or so, the first time)
            raise GrammarError(f"unknown grammar kind {kind!r} (expected one of {', '.join(KINDS)})")
        with self._lock:
            if self._compiler is None:
                self._compiler = self._new_compiler(xgr)
        c = self._compiler
        if kind == "json_schema":
            return c.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":  # OpenAI's json_object is an object, not any JSON value
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return c.compile_regex("|".join(f"(?:{re.escape(s)})" for s in choices))
        assert kind == "grammar"
        return c.compile_grammar(spec)

    def _new_compiler(self, xgr: Any) -> Any:
        tok = self._tokenizer
        vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
        info = xgr.TokenizerInfo(
            vocab,
            xgr.VocabType.BYTE_LEVEL,
            vocab_size=self._vocab_size,
            stop_token_ids=self._stop_token_ids or None,
        )
        # no cache of its own: ours is bounded (Grammars._keep)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def matcher(self, kind: str, spec: str, emitted: Sequence[int] = ()) -> Matcher:
        """A matcher positioned after `emitted` (a resumed request's tokens so far)."""
        import xgrammar as xgr

        key = (kind, spec)
        with self._lock:
            kept = self._ready.get(key)
            if kept is not None:
                self._ready.move_to_end(key)
        if kept is not None:
            compiled = kept[0]
        else:  # dropped since compile_within (or never asked for): compiled here, on the caller's thread
            compiled = self._compiled(kind, spec)
            self._keep(key, compiled)
        m = Matcher(xgr.GrammarMatcher(compiled), self._vocab_size)
        for t in emitted:
            if not m.accept(t):
                raise GrammarError(f"emitted token {t} does not follow the {kind} grammar")
        return m


class Matcher:
    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._m = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def bitmask(self) -> torch.Tensor:
        """int32 [ceil(vocab / 32)]: the tokens allowed next (a fresh copy; the buffer is reused)."""
        self._m.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].clone()

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())
