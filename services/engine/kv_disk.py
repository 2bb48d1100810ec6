"""The local-disk tier of the KV cache (tier 3): blocks pushed out of the host tier, one file per block hash.

Below the host tier (kv_tier.HostKvTier): a block the host tier pushes out to make room is written here instead
of vanishing; with the host tier off, a cached block the pool reuses comes here directly. A prefix lookup that
misses the pool and the host tier continues here; a hit is read, checked, decoded and written into fresh pool
blocks exactly like a host-tier restore (the scheduler and BlockManager drive both).

One directory per worker (`--kv-disk-path`), bounded by `capacity_bytes` (file bytes, header included), oldest
written out first:

    DIR/manifest.json         what the blocks were computed with: model fingerprint, block size, codec, dtype and
                              block shape. A worker that starts on a directory whose manifest matches indexes its
                              blocks (they survive a restart); any difference wipes them, and the log says which.
    DIR/lock                  held (flock) while a worker uses the directory: two workers never share one
    DIR/blocks/<hash>.kv      one block: magic, a JSON header (model fingerprint, block size, codec, dtype, shape,
                              block hash, parent hash, the encoded tensors' dtypes and shapes, payload length,
                              xxh3-64 of the payload), payload. A file is checked against all of it when read, so a
                              block another model wrote (a copied directory) is a miss, not a wrong answer.

The payload is the block in the tier-2 codec (bf16 = the cache dtype as is, fp8, nvfp4 with their scales;
services/engine/kv_codec.py owns the arithmetic), written to a temporary name and renamed into place, so a file
under its final name is always whole. A file that does not parse, is short, has another header than expected or
fails its checksum is a miss: it is deleted, never restored. No fsync: a file lost to a power cut is a miss too.
A directory that stops taking writes or deletions (its permissions, a read-only or vanished filesystem) turns the
tier off for writes: the error is logged once, nothing in the engine fails, blocks it can no longer write are
simply not kept.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from services.engine.kv_tier import EncodedBlock, TierEntry, TierStats, encode_block, encoded_block_bytes
from services.engine.nvfp4.recipe import NVFP4Tensor

log = logging.getLogger("rackserve.engine.kv_disk")

MAGIC = b"RSKVBLK1"
REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)  # a directory's answers that do not change by themselves
MANIFEST_FORMAT = 2  # 2: block headers name the model and block size
_HEAD = struct.Struct("<8sI")  # magic, header length
_NAME = re.compile(r"^[0-9a-f]{16}\.kv$")
_TMP = re.compile(r"^\.[0-9a-f]{16}\.\d+\.tmp$")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _parts(data: EncodedBlock) -> list[torch.Tensor]:
    if isinstance(data, NVFP4Tensor):
        return [data.packed, data.scales, data.global_scale.reshape(1).float()]
    if isinstance(data, tuple):
        return list(data)
    return [data]


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class DiskKvTier:
    """Blocks by hash in files under `path`, bounded by `capacity_bytes`, oldest out first."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        codec: str,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        model_fingerprint: str,
        block_size: int,
    ) -> None:
        self.path = Path(path)
        self.codec = codec
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.capacity_bytes = capacity_bytes
        self.manifest = {
            "format": MANIFEST_FORMAT,
            "model_fingerprint": model_fingerprint,
            "block_size": block_size,
            "codec": codec,
            "dtype": _dtype_name(dtype),
            "block_shape": list(self.block_shape),
        }
        # every header names them; a block file is checked against them
        self.identity = {"model": model_fingerprint, "block_size": block_size}
        # the encoded tensors' dtypes and shapes, as a header lists them
        sample = encode_block(codec, torch.zeros(self.block_shape, dtype=dtype), lambda t: t)
        self.parts = [[_dtype_name(t.dtype), list(t.shape)] for t in _parts(sample)]
        self.writable = True  # False once the directory refused a write or a deletion
        # one block's file, to refuse a bound that cannot hold one (the header's length varies by a few bytes)
        self.block_nbytes = encoded_block_bytes(codec, self.block_shape, dtype) + 512
        if capacity_bytes < self.block_nbytes:
            raise ValueError(
                f"kv_disk_bytes={capacity_bytes} cannot hold one KV block: a block file takes about "
                f"{self.block_nbytes} bytes in codec {codec!r} (0 turns the disk tier off)"
            )
        try:
            self.blocks_dir = self.path / "blocks"
            self.blocks_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ValueError(f"kv_disk_path={str(self.path)!r} cannot be used: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise ValueError(
                f"kv_disk_path={str(self.path)!r} is in use by another process (its lock is held); "
                "every worker needs a directory of its own"
            ) from exc
        # hash -> (parent hash, file bytes), the oldest written first
        self._entries: OrderedDict[int, tuple[int, int]] = OrderedDict()
        # read and checked by lookup() (with the seconds the read took), handed out by take()
        self._staged: dict[int, tuple[TierEntry, float]] = {}
        # reads of the blocks taken since the last observe_restore: part of that restore's time
        self._taken_read_s = 0.0
        self.used_bytes = 0
        self.hits = self.misses = self.restores = self.corrupt = self.overlapped = 0
        # (hash, parent) of blocks forgotten because their files were unsound when read: the caller reports them
        # dropped (take_lost), or the router would go on counting them as this worker's
        self._lost: list[tuple[int, int]] = []
        self.restore_s = 0.0
        self.restore_observer: Callable[[float], None] | None = None
        try:
            self._open_directory()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ start-up
    def _open_directory(self) -> None:
        manifest_path = self.path / "manifest.json"
        reason = ""
        try:
            found = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            found = None
            reason = "it has no manifest"
        except (OSError, ValueError) as exc:
            found = None
            reason = f"its manifest is unreadable ({exc})"
        if isinstance(found, dict):
            diffs = [f"{k} {found.get(k)!r} != {v!r}" for k, v in self.manifest.items() if found.get(k) != v]
            reason = "its blocks were computed with another " + ", ".join(diffs) if diffs else ""
        elif found is not None:
            reason = "its manifest is not an object"
        names = sorted(os.listdir(self.blocks_dir))
        stale = [n for n in names if _TMP.match(n)]  # a write cut short by a crash
        blocks = [n for n in names if _NAME.match(n)]
        for n in stale:
            self._unlink(n)
        if reason:
            if blocks:
                log.warning("KV disk tier %s: wiping %d blocks because %s", self.path, len(blocks), reason)
            for n in blocks:
                self._unlink(n)
            tmp = manifest_path.with_name(f".manifest.{os.getpid()}.tmp")
            try:
                tmp.write_text(json.dumps(self.manifest, sort_keys=True) + "\n")
                os.replace(tmp, manifest_path)
            except OSError as exc:
                raise ValueError(f"kv_disk_path={str(self.path)!r} cannot be used: {exc}") from exc
            return
        indexed = []
        for n in blocks:
            p = self.blocks_dir / n
            try:
                st = p.stat()
                with open(p, "rb") as f:
                    header, _ = self._read_header(f, int(n[:16], 16), st.st_size)
            except (OSError, ValueError) as exc:
                log.warning("KV disk tier %s: dropping %s at start-up: %s", self.path, n, exc)
                self.corrupt += 1
                self._unlink(n)
                continue
            indexed.append((st.st_mtime_ns, int(n[:16], 16), header["parent"], st.st_size))
        for _, h, parent, size in sorted(indexed):  # oldest first, as they were written
            self._entries[h] = (parent, size)
            self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:  # restarted with a smaller bound
            h, (_, size) = self._entries.popitem(last=False)
            self.used_bytes -= size
            self._unlink(self._name(h))
        log.info(
            "KV disk tier %s: %d blocks (%d bytes) kept from before (manifest matches)",
            self.path, len(self._entries), self.used_bytes,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ queries
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self) -> list[int]:
        return list(self._entries)

    def parent_of(self, block_hash: int) -> int:
        return self._entries[block_hash][0]

    def stats(self) -> TierStats:
        return TierStats(
            self.capacity_bytes, self.used_bytes, len(self._entries), self.hits, self.misses,
            self.restores, self.restore_s, self.overlapped,
        )  # fmt: skip

    def lookup(self, hashes: list[int]) -> int:
        """How many leading hashes this tier can restore: each file is read and checked now, so a corrupt one
        is a miss (and deleted) before anything counts on it. The entries wait for take()."""
        wanted = set(hashes)
        staged = {h: e for h, e in self._staged.items() if h in wanted}  # a request still waiting for blocks
        n = 0
        for h in hashes:
            if h not in staged:
                if h not in self._entries:
                    break
                t0 = time.perf_counter()
                e = self._read(h)
                if e is None:
                    break
                staged[h] = (e, time.perf_counter() - t0)
            n += 1
        self._staged = staged
        return n

    # ------------------------------------------------------------------------------------------ mutations
    def put(self, block_hash: int, parent_hash: int, data: EncodedBlock) -> list[tuple[int, int]]:
        """Write one encoded block under its hash. Returns the (hash, parent) pairs of other blocks pushed out to
        make room, oldest first. A block that cannot be written (a full or failing disk: logged, the worker goes
        on) is simply not here afterwards: the caller announces it only `if block_hash in tier`."""
        was_here = self.discard(block_hash) is not None
        dropped: list[tuple[int, int]] = []
        if not self.writable:
            return [(block_hash, parent_hash)] * was_here
        parts = _parts(data)
        payload = b"".join(_raw(t) for t in parts)
        header = json.dumps(
            {
                **self.identity,
                "codec": self.codec,
                "dtype": _dtype_name(self.dtype),
                "shape": list(self.block_shape),
                "hash": block_hash,
                "parent": parent_hash,
                "parts": [[_dtype_name(t.dtype), list(t.shape)] for t in parts],
                "payload_bytes": len(payload),
                "xxh3_64": xxhash.xxh3_64_hexdigest(payload),
            },
            sort_keys=True,
        ).encode()
        size = _HEAD.size + len(header) + len(payload)
        while self._entries and self.used_bytes + size > self.capacity_bytes:
            dropped.append(self._drop_oldest())
        # (not writable: an eviction above may have found out)
        if self.used_bytes + size > self.capacity_bytes or not self.writable:
            return dropped + [(block_hash, parent_hash)] * was_here
        name = self._name(block_hash)
        tmp = self.blocks_dir / f".{name[:16]}.{os.getpid()}.tmp"
        while True:
            try:
                try:
                    self._write(tmp, header, payload)
                except FileNotFoundError:  # blocks/ removed under us: make it again, once
                    self.blocks_dir.mkdir(parents=True, exist_ok=True)
                    self._write(tmp, header, payload)
                os.replace(tmp, self.blocks_dir / name)
                break
            except OSError as exc:
                self._unlink(tmp.name)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self._entries and self.writable:
                    # the filesystem is full before the bound (a volume smaller than it, other files on it): the
                    # oldest blocks make room, as for the bound, or it would keep them and refuse every newer one
                    dropped.append(self._drop_oldest())
                    continue
                if exc.errno in REFUSED:  # the directory refuses writes for good: stop (logged once)
                    self._stop_writing(exc)
                else:  # a full disk, say, may pass: this block is lost, the next one is tried
                    log.warning("KV disk tier %s: cannot write block %016x: %s", self.path, block_hash, exc)
                return dropped + [(block_hash, parent_hash)] * was_here
        self._entries[block_hash] = (parent_hash, size)
        self.used_bytes += size
        return dropped

    def _drop_oldest(self) -> tuple[int, int]:
        """Push out the oldest written block; its (hash, parent)."""
        h, (parent, n) = self._entries.popitem(last=False)
        self.used_bytes -= n
        self._staged.pop(h, None)
        self._unlink(self._name(h))
        return h, parent

    def take(self, block_hash: int) -> TierEntry:
        """Remove a block to restore it (lookup() read and checked it); KeyError if it cannot be restored."""
        staged = self._staged.pop(block_hash, None)
        if staged is None:
            if block_hash not in self._entries:
                raise KeyError(block_hash)
            t0 = time.perf_counter()
            e = self._read(block_hash)
            if e is None:
                raise KeyError(block_hash)
            staged = (e, time.perf_counter() - t0)
        self._taken_read_s += staged[1]
        self.discard(block_hash)
        return staged[0]

    def discard(self, block_hash: int) -> tuple[int, int] | None:
        """Drop a block (it is in the pool again, or being rewritten); its (hash, parent) if it was here."""
        self._staged.pop(block_hash, None)
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return None
        self.used_bytes -= entry[1]
        self._unlink(self._name(block_hash))
        return block_hash, entry[0]

    def take_lost(self) -> list[tuple[int, int]]:
        """The (hash, parent) of blocks forgotten since the last call because their files were unsound."""
        lost, self._lost = self._lost, []
        return lost

    def observe_restore(self, num_blocks: int, seconds: float, overlapped: bool = False) -> None:
        """One request's restore: `seconds` of decode + write, plus the reads of its files (at admission)."""
        seconds += self._taken_read_s
        self._taken_read_s = 0.0
        self.hits += num_blocks
        self.restores += 1
        self.overlapped += overlapped
        self.restore_s += seconds
        if self.restore_observer is not None:
            self.restore_observer(seconds)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # ------------------------------------------------------------------------------------------ files
    @staticmethod
    def _name(block_hash: int) -> str:
        return f"{block_hash:016x}.kv"

    @staticmethod
    def _write(path: Path, header: bytes, payload: bytes) -> None:
        with open(path, "wb") as f:
            f.write(_HEAD.pack(MAGIC, len(header)))
            f.write(header)
            f.write(payload)

    def _unlink(self, name: str) -> None:
        """Delete a block file the index no longer counts. A deletion the directory refuses never fails the
        caller (an engine step): the file stays, unindexed, and the tier stops writing (any other failure is
        logged and the tier goes on)."""
        try:
            (self.blocks_dir / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno in REFUSED:
                self._stop_writing(exc)
            else:  # e.g. a directory under a block's name: only that name is lost to the tier, not every write
                log.warning("KV disk tier %s: cannot delete %s: %s", self.path, name, exc)

    def _stop_writing(self, exc: OSError) -> None:
        if self.writable:
            log.warning("KV disk tier %s: the directory refuses changes (%s); no more blocks are written to it "
                        "until the worker restarts", self.path, exc)  # fmt: skip
        self.writable = False

    def _read_header(self, f: BinaryIO, block_hash: int, size: int) -> tuple[dict[str, Any], int]:
        """Parse and check a file's header against what this tier expects; (header, payload length)."""
        head = f.read(_HEAD.size)
        if len(head) != _HEAD.size:
            raise ValueError("short file")
        magic, hlen = _HEAD.unpack(head)
        if magic != MAGIC or hlen > 1 << 16:
            raise ValueError("not a rackserve KV block file")
        raw = f.read(hlen)
        if len(raw) != hlen:
            raise ValueError("short header")
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("its header is not an object")
        expected = {
            **self.identity,
            "codec": self.codec,
            "dtype": _dtype_name(self.dtype),
            "shape": list(self.block_shape),
            "hash": block_hash,
            "parts": self.parts,
        }
        for k, v in expected.items():
            if header.get(k) != v:
                raise ValueError(f"header {k} {header.get(k)!r}, expected {v!r}")
        plen, parent = header.get("payload_bytes"), header.get("parent")
        if type(plen) is not int or type(parent) is not int or not isinstance(header.get("xxh3_64"), str):
            raise ValueError("its header lacks a payload length, a parent hash or a checksum")
        if size != _HEAD.size + hlen + plen:
            raise ValueError(f"{size} bytes, the header says {_HEAD.size + hlen + plen}")
        return header, plen

    def _read(self, block_hash: int) -> TierEntry | None:
        """Read and check one block file; None (and the file deleted, the block forgotten) if it is not sound."""
        p = self.blocks_dir / self._name(block_hash)
        try:
            with open(p, "rb") as f:
                header, plen = self._read_header(f, block_hash, os.fstat(f.fileno()).st_size)
                payload = f.read(plen)
            if len(payload) != plen:
                raise ValueError("short payload")
            if xxhash.xxh3_64_hexdigest(payload) != header["xxh3_64"]:
                raise ValueError("checksum mismatch")
            data = self._decode_payload(header, payload)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            log.warning("KV disk tier %s: block %016x is a miss: %s", self.path, block_hash, exc)
            self.corrupt += 1
            gone = self.discard(block_hash)
            if gone is not None:
                self._lost.append(gone)
            return None
        return TierEntry(header["parent"], _HEAD.size + len(payload), data, tier="disk")

    def _decode_payload(self, header: dict[str, Any], payload: bytes) -> EncodedBlock:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        tensors: list[torch.Tensor] = []
        off = 0
        for dtype_name, shape in header["parts"]:
            dt = _dtype(dtype_name)
            n = 1
            for d in shape:
                n *= int(d)
            nbytes = n * torch.empty(0, dtype=dt).element_size()
            tensors.append(buf[off : off + nbytes].view(dt).view(tuple(shape)))
            off += nbytes
        if off != len(payload):
            raise ValueError("payload length does not match its parts")
        if self.codec == "bf16" and len(tensors) == 1:
            return tensors[0]
        if self.codec == "fp8" and len(tensors) == 2:
            return tensors[0], tensors[1]
        if self.codec == "nvfp4" and len(tensors) == 3:
            return NVFP4Tensor(tensors[0], tensors[1], tensors[2].reshape(()), self.block_shape)
        raise ValueError(f"{len(tensors)} tensors do not make a {self.codec} block")
