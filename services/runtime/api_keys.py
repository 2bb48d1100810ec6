"""API keys: what a key must be and how `--api-key`, RACKSERVE_API_KEY and `--api-key-file` are read.

The frontend checks requests against them (services/frontend/auth.py); `rackserve up` reads its `--api-key` with
the same rules before it starts anything, so a key the frontend would refuse is named at once, not after etcd and
every worker have started.

The key file (a mounted Kubernetes Secret) holds one key per line: `KEY [name=NAME] [models=a,b]`; `#` at the
start of a line or after a space starts a comment (inside a key it is part of it). Names and keys are unique, a
key has at least MIN_KEY_CHARS characters, and an error names the line and the field, never a word of it (a
misplaced secret would otherwise be printed). Only each key's SHA-256 is kept, never the secret.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

MAX_TOKEN_CHARS = 512  # longer Authorization values are refused before hashing anything
MIN_KEY_CHARS = 8  # a one-character key is a guess away


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes = field(repr=False)  # SHA-256 of the secret; the secret itself is not kept
    models: frozenset[str] | None = None  # None: every model

    @classmethod
    def from_secret(cls, secret: str, name: str, models: frozenset[str] | None = None) -> ApiKey:
        if not secret or any(c.isspace() for c in secret):
            raise ValueError(f"API key {name!r}: empty or contains whitespace")
        if len(secret) < MIN_KEY_CHARS:
            raise ValueError(f"API key {name!r}: shorter than {MIN_KEY_CHARS} characters")
        if len(secret) > MAX_TOKEN_CHARS:
            raise ValueError(
                f"API key {name!r}: longer than {MAX_TOKEN_CHARS} characters (no client could send it)"
            )
        return cls(name, hashlib.sha256(secret.encode()).digest(), models)


def load_api_keys(flag_value: str = "", key_file: str = "") -> tuple[ApiKey, ...]:
    """Keys from `--api-key` (comma-separated) and the lines of `--api-key-file`; () means the API is open."""
    keys = [
        ApiKey.from_secret(s.strip(), f"key-{i}") for i, s in enumerate(flag_value.split(",")) if s.strip()
    ]
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {key_file}: {e.strerror or e}") from e
        for n, line in enumerate(lines, 1):
            words = []
            for word in line.split():
                if word.startswith("#"):  # a comment: the line's start or after a space (a key may hold a #)
                    break
                words.append(word)
            if not words:
                continue
            name, models = f"{Path(key_file).name}:{n}", None
            for i, word in enumerate(words[1:], 2):
                attr, _, value = word.partition("=")
                if attr == "name" and value:
                    name = value
                elif attr == "models" and value:
                    models = frozenset(m for m in value.split(",") if m)
                else:  # the word is not shown: it may be a secret written in the wrong place
                    raise ValueError(
                        f"--api-key-file {key_file} line {n}: word {i} is not name=NAME or models=a,b "
                        "(expected KEY [name=NAME] [models=a,b])"
                    )
            keys.append(ApiKey.from_secret(words[0], name, models))
    names = [k.name for k in keys]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:  # two keys of one name share a rate limit and read each other's timelines
        raise ValueError(f"API keys: the same name is given twice: {', '.join(repeated)}")
    if len({k.digest for k in keys}) < len(keys):  # which one is not shown: it is a secret
        raise ValueError("API keys: the same key is given twice: (not shown)")
    return tuple(keys)
