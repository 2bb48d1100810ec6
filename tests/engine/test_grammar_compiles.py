"""Grammar compiles off the event loop (services.engine.structured.Grammars.compile_within) when some are costly."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.engine.structured import GrammarError, Grammars
from services.engine.tokenizer import Tokenizer


def costly(depth: int) -> str:
    """A JSON schema whose grammar takes seconds to compile (nested bounded repeats; ~3 s at 4 here)."""
    return json.dumps({"type": "string", "pattern": f"(([a-z]{{0,4}}){{0,4}}){{0,{depth}}}"})


def test_costly_compiles_holding_every_thread_hold_up_no_grammar_compiled_before(gguf_path: str) -> None:
    """Two costly schemas took both compile threads; every later json_object request was refused for as long as
    they ran, and the refused ones still compiled afterwards, one after another (the security audit, until
    2026-12-07). A grammar compiled before needs no thread, and a compile nobody waits for any more never runs:
    the next request for it starts at once."""
    tok = Tokenizer.from_gguf(gguf_path)
    g = Grammars(tok, tok.vocab_size, tok.stop_token_ids)

    async def body() -> list[BaseException | None]:
        await g.compile_within("json_object", "", 30.0)  # compiled once, early
        tries = [g.compile_within("json_schema", costly(d), 0.3) for d in (4, 5)]
        refused = await asyncio.gather(*tries, return_exceptions=True)
        await g.compile_within("json_object", "", 0.3)  # both threads busy: passes anyway
        with pytest.raises(GrammarError, match="did not compile within 0.3 s"):
            await g.compile_within("regex", "[a-z]+", 0.3)  # new, queued behind them: refused
        await g.compile_within("regex", "[a-z]+", 60.0)  # asked again: compiled (the abandoned one never ran)
        return list(refused)

    refused = asyncio.run(body())
    assert all(isinstance(e, GrammarError) for e in refused), refused
