"""Constrained decoding with xgrammar: a request's grammar (JSON schema, any JSON object, regex, a choice of
strings, or EBNF) becomes a matcher whose packed bitmask of allowed next tokens the batched sampler applies.

The matcher's state is a function of the tokens emitted so far, so a request resumed elsewhere rebuilds it by
replaying its emitted tokens — the recovery contract holds for constrained requests too. xgrammar is
imported only when a request asks for a grammar.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """The grammar does not compile (a bad schema, regex or EBNF)."""


class Grammars:
    """Compiles grammars for one tokenizer (compilations are cached by xgrammar) and opens matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None

    def _compile(self, kind: str, spec: str) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            tok = self._tokenizer
            vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
            info = xgr.TokenizerInfo(
                vocab,
                xgr.VocabType.BYTE_LEVEL,
                vocab_size=self._vocab_size,
                stop_token_ids=self._stop_token_ids or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
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
        if kind == "grammar":
            return c.compile_grammar(spec)
        raise GrammarError(f"unknown grammar kind {kind!r} (expected one of {', '.join(KINDS)})")

    def matcher(self, kind: str, spec: str, emitted: Sequence[int] = ()) -> Matcher:
        """A matcher positioned after `emitted` (a resumed request's tokens so far)."""
        import xgrammar as xgr

        try:
            compiled = self._compile(kind, spec)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError for a bad schema, regex or EBNF
            raise GrammarError(f"the {kind} grammar does not compile: {e}") from e
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
