"""Transfer failures, one class per thing the caller can do about it.

TransferTimeout: retry elsewhere or rebuild; TransferNotFound: the producer no longer holds the key (expired,
retracted, wrong key) — rebuild by re-prefill; TransferPeerGone: the producer died or closed mid-transfer —
rebuild; TransferIntegrityError: bytes arrived but are not what was published — never use them.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base class: the KV did not arrive intact."""


class TransferTimeout(TransferError, TimeoutError):
    """The transfer did not finish within its deadline."""


class TransferNotFound(TransferError, LookupError):
    """The producer does not hold this key (never published, retracted, or expired)."""


class TransferPeerGone(TransferError, ConnectionError):
    """The producer went away (refused, reset, closed, or its NIXL agent disconnected)."""


class TransferIntegrityError(TransferError):
    """The bytes that arrived differ in size or checksum from what the producer published."""


class TransferUnavailable(TransferError):
    """The requested backend is not enabled on this side or not advertised by the producer."""
