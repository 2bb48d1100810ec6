"""The messages of a pull's control exchange, typed: what the sink and the source say to each other.

    sink -> source  Open(key, serial, backend[, eager][, device])
                                       {"op":"open","key":…,"serial":…,"backend":…[,"eager":true][,"device":true]}
    source -> sink  Grant(size, checksum, encoding, serial[, shm | nixl | cuda_ipc])
                                                       {"ok":true,"size":…,"checksum":…,"encoding":…,"serial":…,…}
                    or Refusal(error, detail)          {"ok":false,"error":…,"detail":…}
    sink -> source  Done()                             {"op":"done"}   (shm, nixl, cuda_ipc: the read is over)

Each message is a frozen dataclass with `to_wire()` (the JSON object protocol.py frames; key order and spelling
are the wire format, unchanged since the messages were plain dicts) and `from_wire()`, which refuses a message
that does not have this shape with a `ControlMessageError` naming the field. protocol.py frames the messages and
the exchange itself (open, reply, move, done) is sink.py's and source.py's.

This module only defines messages: no sockets, no payloads, no backend logic.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

# why a source refuses an open (Refusal.error)
BAD_REQUEST = "bad_request"  # not an open, or a malformed one
NOT_FOUND = "not_found"  # the source holds no publication under this key
UNAVAILABLE = "unavailable"  # the source does not offer this backend for this publication

_T = TypeVar("_T")


class ControlMessageError(ValueError):
    """A control message that is not the message this protocol expects at that point."""


def _field(msg: Mapping[str, Any], what: str, name: str, kind: type[_T], default: _T | None = None) -> _T:
    """msg[name] if it is a `kind` (bool is no int here), else ControlMessageError; `default` when absent."""
    if name not in msg:
        if default is None:
            raise ControlMessageError(f"{what}: missing {name!r}")
        return default
    value = msg[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ControlMessageError(f"{what}: {name!r} must be {kind.__name__}, got {value!r}")
    return value


def _op(msg: Mapping[str, Any], expected: str) -> None:
    if msg.get("op") != expected:
        raise ControlMessageError(f"expected {expected}")


@dataclass(frozen=True)
class Open:
    """Sink -> source: pin the publication `key` and say how to read it over `backend`. `serial` is the one in
    the reader's ticket: the publication's secret, so only a holder of the ticket (which travels inside the
    services' gRPC calls, under their TLS) can read it — the source refuses any other as not found. An eager
    NIXL reader already READs the region its ticket names, so the reply need not carry the agent metadata.
    `device`: a NIXL reader wants the producer's device copy (raw bytes in GPU memory), not the published
    bytes."""

    key: str
    serial: str
    backend: str
    eager: bool = False
    device: bool = False

    def to_wire(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": "open", "key": self.key, "serial": self.serial, "backend": self.backend}
        if self.eager:
            msg["eager"] = True
        if self.device:
            msg["device"] = True
        return msg

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Open:
        _op(msg, "open")
        return cls(
            key=_field(msg, "open", "key", str),
            serial=_field(msg, "open", "serial", str),
            backend=_field(msg, "open", "backend", str),
            eager=_field(msg, "open", "eager", bool, False),
            device=_field(msg, "open", "device", bool, False),
        )


@dataclass(frozen=True)
class NixlRegion:
    """Where a NIXL reader READs: the registered address, the source's agent name and its metadata (None when
    the reader took the metadata from its ticket)."""

    addr: int
    agent: str
    md: bytes | None = None

    def to_wire(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"addr": self.addr, "agent": self.agent}
        if self.md is not None:
            msg["md"] = base64.b64encode(self.md).decode()
        return msg

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> NixlRegion:
        md = msg.get("md")
        if md is not None and not isinstance(md, str):
            raise ControlMessageError(f"reply nixl: 'md' must be str, got {md!r}")
        try:
            raw = None if md is None else base64.b64decode(md, validate=True)
        except binascii.Error as e:
            raise ControlMessageError(f"reply nixl: 'md' is not base64: {e}") from e
        return cls(
            addr=_field(msg, "reply nixl", "addr", int), agent=_field(msg, "reply nixl", "agent", str), md=raw
        )


@dataclass(frozen=True)
class Grant:
    """Source -> sink, yes to an open: the publication it holds (pinned until Done or disconnect) and, for shm,
    nixl and cuda_ipc, where to read it (TCP: the bytes follow the reply on the connection)."""

    size: int
    checksum: str
    encoding: str
    serial: str
    shm: str | None = None  # the shared-memory segment's name
    nixl: NixlRegion | None = None
    cuda_ipc: bool = False  # the device copy is pinned for this reader
    # cuda_ipc: the device copy's description (cuda_ipc.describe, JSON), shared for this reader alone: torch
    # counts each share until a reader's mapping goes, so a share nobody opens would keep the copy forever
    device_handle: str | None = None

    ok = True

    def to_wire(self) -> dict[str, Any]:
        msg: dict[str, Any] = {
            "ok": True,
            "size": self.size,
            "checksum": self.checksum,
            "encoding": self.encoding,
            "serial": self.serial,
        }
        if self.shm is not None:
            msg["shm"] = self.shm
        if self.nixl is not None:
            msg["nixl"] = self.nixl.to_wire()
        if self.cuda_ipc:
            msg["cuda_ipc"] = True
        if self.device_handle is not None:
            msg["device_handle"] = self.device_handle
        return msg

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Grant:
        if msg.get("ok") is not True:
            raise ControlMessageError(f"expected a granting reply, got {msg!r}"[:200])
        nixl = msg.get("nixl")
        if nixl is not None and not isinstance(nixl, Mapping):
            raise ControlMessageError(f"reply: 'nixl' must be an object, got {nixl!r}")
        shm = msg.get("shm")
        if shm is not None and not isinstance(shm, str):
            raise ControlMessageError(f"reply: 'shm' must be str, got {shm!r}")
        handle = msg.get("device_handle")
        if handle is not None and not isinstance(handle, str):
            raise ControlMessageError(f"reply: 'device_handle' must be str, got {handle!r}")
        return cls(
            size=_field(msg, "reply", "size", int),
            checksum=_field(msg, "reply", "checksum", str),
            encoding=_field(msg, "reply", "encoding", str),
            serial=_field(msg, "reply", "serial", str),
            shm=shm,
            nixl=None if nixl is None else NixlRegion.from_wire(nixl),
            cuda_ipc=_field(msg, "reply", "cuda_ipc", bool, False),
            device_handle=handle,
        )


@dataclass(frozen=True)
class Refusal:
    """Source -> sink, no to an open: `error` is BAD_REQUEST, NOT_FOUND or UNAVAILABLE, `detail` says what."""

    error: str
    detail: str

    ok = False

    def to_wire(self) -> dict[str, Any]:
        return {"ok": False, "error": self.error, "detail": self.detail}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Refusal:
        if msg.get("ok") is not False:
            raise ControlMessageError(f"expected a refusal, got {msg!r}"[:200])
        return cls(
            error=_field(msg, "refusal", "error", str), detail=_field(msg, "refusal", "detail", str, "")
        )


@dataclass(frozen=True)
class Done:
    """Sink -> source: the read is over; the source unpins the publication and waits for the next open."""

    def to_wire(self) -> dict[str, Any]:
        return {"op": "done"}

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Done:
        _op(msg, "done")
        return cls()


Reply = Grant | Refusal
ControlMessage = Open | Grant | Refusal | Done


def reply_from_wire(msg: Mapping[str, Any]) -> Reply:
    """The source's reply to an open: a Grant or a Refusal, else ControlMessageError."""
    ok = msg.get("ok")
    if ok is True:
        return Grant.from_wire(msg)
    if ok is False:
        return Refusal.from_wire(msg)
    raise ControlMessageError(f"reply: 'ok' must be true or false, got {msg!r}"[:200])
