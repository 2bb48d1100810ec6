"""KV transfer (services/kvtransfer): real sockets, real /dev/shm segments, real NIXL agents, and the producer in
its own process wherever the behaviour depends on it (pulls across processes, a producer that dies)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from services.kvtransfer import (
    NIXL,
    SHM,
    TCP,
    KvSink,
    KvSource,
    TransferConfig,
    TransferIntegrityError,
    TransferNotFound,
    TransferPeerGone,
    TransferTicket,
    TransferTimeout,
    choose_backend,
)
from services.kvtransfer import shm as shm_mod
from services.kvtransfer import source as source_mod
from services.kvtransfer.nixl import load_nixl
from services.kvtransfer.ticket import CUDA_IPC, Checksum, checksum_of
from tests.support.markers import starts_processes

try:
    load_nixl()
    HAVE_NIXL = True
except Exception:
    HAVE_NIXL = False


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


BACKENDS = [TCP, SHM, pytest.param(NIXL, marks=pytest.mark.skipif(not HAVE_NIXL, reason="nixl-cu12 missing"))]
KiB, MiB = 1 << 10, 1 << 20
needs_nixl_mark = pytest.mark.skipif(not HAVE_NIXL, reason="nixl-cu12 missing")


def payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def kv_floats(size: int, seed: int) -> bytes:
    """`size` bytes of fp32 KV values (finite, so the wire's compression applies)."""
    return np.random.default_rng(seed).standard_normal(size // 4, dtype=np.float32).tobytes()


# --- a producer in its own process, driven over a pipe ---
def _producer_main(conn: Any, stall_after_bytes: int | None, config: TransferConfig | None) -> None:
    async def serve() -> None:
        source = await KvSource.start(config or TransferConfig())
        source._test_stall_after_bytes = stall_after_bytes
        loop = asyncio.get_running_loop()
        while True:
            cmd, *args = await loop.run_in_executor(None, conn.recv)
            if cmd == "publish":
                key, size, seed, ttl_s = args
                t = await source.publish(key, payload(size, seed), ttl_s)
                conn.send((t.to_json(), t.agent_metadata))
            elif cmd == "publish_device":  # fp32 KV, with the device copy a GPU producer's export offers
                key, size, seed, compress, device = args
                raw = kv_floats(size, seed)
                copy = None
                if device:
                    import torch

                    copy = torch.frombuffer(bytearray(raw), dtype=torch.float32).to(device)
                t = await source.publish(
                    key, raw, 60.0, compress=compress, kv_dtype="fp32", head_dim=64, device_payload=copy
                )
                conn.send((t.to_json(), t.agent_metadata))
            elif cmd == "retract":
                source.retract(*args)
                conn.send(None)
            elif cmd == "flip":
                source._flip_byte_for_test(*args)
                conn.send(None)
            elif cmd == "stop":
                await source.close()
                conn.send(None)
                return

    asyncio.run(serve())


class Producer:
    def __init__(self, stall_after_bytes: int | None = None, config: TransferConfig | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer_main, args=(child, stall_after_bytes, config), daemon=True)
        self.proc.start()

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(30):
            raise TimeoutError(f"producer did not answer {cmd[0]}")
        return self.conn.recv()

    def publish(self, key: str, size: int, seed: int = 0, ttl_s: float = 60.0) -> TransferTicket:
        text, md = self.call("publish", key, size, seed, ttl_s)
        return TransferTicket.from_json(text, md)  # as the decode worker rebuilds it from a KvHandle

    def publish_device(
        self, key: str, size: int, seed: int = 0, compress: str | None = None, device: str = "cpu"
    ) -> TransferTicket:
        """fp32 KV published with a device copy on `device` ("": none) beside the (maybe compressed) bytes."""
        text, md = self.call("publish_device", key, size, seed, compress, device)
        return TransferTicket.from_json(text, md)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (TimeoutError, OSError, EOFError):
                pass
            self.proc.join(10)
        self.kill()


@pytest.fixture(scope="module")
@starts_processes
def producer() -> Iterator[Producer]:
    p = Producer()
    yield p
    p.stop()


def pull(
    ticket: TransferTicket,
    backend: str,
    deadline_s: float = 20.0,
    config: TransferConfig | None = None,
    **kw: Any,
) -> Any:
    async def go() -> Any:
        sink = await KvSink.start(config or TransferConfig())
        try:
            return await sink.pull(ticket, deadline_s, backend=backend, **kw)
        finally:
            await sink.close()

    return asyncio.run(go())


# --- round trips ---
@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_from_another_process_returns_identical_bytes(producer: Producer, backend: str) -> None:
    for i, size in enumerate((1 * KiB, 1 * MiB, 16 * MiB)):
        ticket = producer.publish(f"rt-{backend}-{size}", size, seed=i)
        got = pull(ticket, backend)
        assert got.backend == backend and got.bytes == size and got.seconds > 0
        assert bytes(got.data) == payload(size, i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_into_a_reused_buffer_fills_it(producer: Producer, backend: str) -> None:
    ticket = producer.publish(f"into-{backend}", 1 * MiB, seed=7)
    buf = bytearray(2 * MiB)
    got = pull(ticket, backend, into=buf)
    assert bytes(got.data) == payload(1 * MiB, 7) and bytes(buf[: 1 * MiB]) == payload(1 * MiB, 7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_key_is_transfer_not_found(producer: Producer, backend: str) -> None:
    ticket = producer.publish(f"real-{backend}", 1 * KiB)
    with pytest.raises(TransferNotFound):
        pull(dataclasses.replace(ticket, key=f"nope-{backend}"), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flipped_byte_is_integrity_error(producer: Producer, backend: str) -> None:
    ticket = producer.publish(f"flip-{backend}", 1 * MiB)
    producer.call("flip", f"flip-{backend}", 12345)
    with pytest.raises(TransferIntegrityError, match="checksum"):  # NIXL verifies it when asked to
        pull(ticket, backend, config=TransferConfig(nixl_verify_checksum=True))


@needs_nixl_mark
def test_nixl_pull_by_default_checks_size_and_publication_not_the_checksum(producer: Producer) -> None:
    ticket = producer.publish("flip-default", 1 * MiB, seed=5)
    producer.call("flip", "flip-default", 12345)  # a producer bug: bytes changed after publish
    got = pull(ticket, NIXL)  # the default NIXL check leaves this to the transport (README: KV transfer)
    assert got.bytes == 1 * MiB and bytes(got.data) != payload(1 * MiB, 5)
    with pytest.raises(TransferIntegrityError, match="checksum"):
        pull(ticket, TCP)  # TCP and shm pulls always verify the checksum


needs_nixl = needs_nixl_mark


@needs_nixl
def test_nixl_chunked_check_catches_a_flipped_byte_in_the_last_chunk(producer: Producer) -> None:
    size = 5 * MiB + 123  # chunks of 1 MiB: the flip lands in the sixth, partial chunk
    ticket = producer.publish("flip-late", size)
    assert ticket.checksum.startswith("xxh3:")
    producer.call("flip", "flip-late", size - 7)
    with pytest.raises(TransferIntegrityError, match="checksum"):
        pull(ticket, NIXL, config=TransferConfig(nixl_chunk_bytes=1 * MiB, nixl_verify_checksum=True))


@pytest.mark.parametrize("check", ["xxh3", "crc32", "none"])
def test_checksum_fed_in_pieces_equals_the_one_shot_value_and_changes_with_one_bit(check: str) -> None:
    data = bytearray(payload(3 * MiB + 5, 9))
    pieces = Checksum(check)
    for start in range(0, len(data), 1 * MiB):
        pieces.update(memoryview(data)[start : start + 1 * MiB])
    assert pieces.hexdigest() == checksum_of(data, check)
    data[-1] ^= 1
    assert (checksum_of(data, check) != pieces.hexdigest()) == (check != "none")


@pytest.mark.cluster
def test_nixl_only_producer_serves_payloads_across_chunk_and_page_boundaries() -> None:
    p = Producer(config=TransferConfig(backends=(TCP, NIXL), nixl_chunk_bytes=1 * MiB))
    try:
        for i, size in enumerate((1 * KiB, 2 * MiB, 5 * MiB + 123)):  # unstaged, one huge page, partial chunk
            ticket = p.publish(f"staged-{size}", size, seed=20 + i)
            assert SHM not in ticket.backends
            for backend in [TCP, NIXL] if HAVE_NIXL else [TCP]:
                got = pull(ticket, backend, config=TransferConfig(nixl_chunk_bytes=1 * MiB))
                assert got.bytes == size and bytes(got.data) == payload(size, 20 + i)
    finally:
        p.stop()


@needs_nixl
@pytest.mark.parametrize("lanes", [2, 3])
def test_nixl_pull_split_over_lanes_returns_every_byte_in_place(producer: Producer, lanes: int) -> None:
    """A READ split over several agents (contiguous page-aligned parts, the last one ragged) lands each part at
    its offset, into a fresh buffer and into a reused larger one; with the checksum verified it stays whole."""
    size = 9 * MiB + 4321
    ticket = producer.publish(f"lanes-{lanes}", size, seed=31)
    config = TransferConfig(nixl_lanes=lanes, nixl_lane_min_bytes=1 * MiB)

    async def pull_and_count_reading_agents() -> tuple[bytes, int]:
        sink = await KvSink.start(config)
        try:
            got = await sink.pull(ticket, 20.0, backend=NIXL)
            return bytes(got.data), sum(1 for peers in sink._peers.values() if peers)
        finally:
            await sink.close()

    data, readers = asyncio.run(pull_and_count_reading_agents())
    assert data == payload(size, 31) and readers == lanes  # every lane read its part
    into = bytearray(size + 3 * 4096)
    got = pull(ticket, NIXL, config=config, into=into)
    assert bytes(got.data) == payload(size, 31) and bytes(into[:size]) == payload(size, 31)
    checked = TransferConfig(nixl_lanes=lanes, nixl_lane_min_bytes=1 * MiB, nixl_verify_checksum=True)
    assert bytes(pull(ticket, NIXL, config=checked).data) == payload(size, 31)


def test_transfer_config_refuses_zero_lanes() -> None:
    with pytest.raises(ValueError, match="nixl_lanes"):
        TransferConfig(nixl_lanes=0)


@needs_nixl
@pytest.mark.cluster
def test_sink_pulls_from_a_restarted_producer_after_pulling_from_its_predecessor() -> None:
    async def go() -> None:
        sink = await KvSink.start(TransferConfig())
        buf = bytearray(4 * MiB)  # one reused, registered receive buffer across both producers
        try:
            for generation in range(2):
                p = Producer(config=TransferConfig(backends=(TCP, NIXL)))
                try:
                    ticket = p.publish("same-key", 3 * MiB, seed=generation)
                    got = await sink.pull(ticket, 20.0, backend=NIXL, into=buf)
                    assert bytes(got.data) == payload(3 * MiB, generation)
                finally:
                    p.stop()
        finally:
            await sink.close()

    asyncio.run(go())


def test_ticket_promising_more_bytes_than_published_is_integrity_error(producer: Producer) -> None:
    ticket = producer.publish("short", 1 * KiB)
    with pytest.raises(TransferIntegrityError):
        pull(dataclasses.replace(ticket, size=ticket.size + 100), TCP)


# --- a producer that dies or stalls ---
@pytest.mark.cluster
def test_producer_killed_mid_tcp_stream_raises_peer_gone_before_deadline() -> None:
    p = Producer(stall_after_bytes=4 * MiB)
    try:
        ticket = p.publish("dying", 16 * MiB)

        async def go() -> float:
            sink = await KvSink.start(TransferConfig(backends=(TCP,)))
            task = asyncio.create_task(sink.pull(ticket, 20.0, backend=TCP))
            await asyncio.sleep(0.5)  # the sink is now waiting for bytes that do not come
            assert not task.done()
            t0 = time.monotonic()
            p.kill()
            with pytest.raises(TransferPeerGone):
                await task
            await sink.close()
            return time.monotonic() - t0

        assert asyncio.run(go()) < 5.0  # the connection reset, not the 20 s deadline, ended it
    finally:
        p.kill()


@pytest.mark.cluster
def test_stalled_producer_hits_the_deadline_as_transfer_timeout() -> None:
    p = Producer(stall_after_bytes=1 * MiB)
    try:
        ticket = p.publish("stalled", 4 * MiB)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            pull(ticket, TCP, deadline_s=1.0)
        assert time.monotonic() - t0 < 5.0
    finally:
        p.stop()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.cluster
def test_pull_after_producer_died_raises_peer_gone_quickly(backend: str) -> None:
    p = Producer()
    ticket = p.publish("orphan", 1 * MiB)
    p.kill()
    t0 = time.monotonic()
    with pytest.raises(TransferPeerGone):
        pull(ticket, backend, deadline_s=10.0)
    assert time.monotonic() - t0 < 5.0


@pytest.mark.cluster
def test_segments_of_a_killed_producer_are_swept_by_the_next_source() -> None:
    p = Producer()
    p.publish("left-behind", 64 * KiB)
    pid = p.proc.pid
    p.kill()
    assert any(n.startswith(f"{shm_mod.PREFIX}{pid}-") for n in os.listdir("/dev/shm"))

    async def restart() -> None:
        await (await KvSource.start(TransferConfig(backends=(TCP, SHM)))).close()

    asyncio.run(restart())
    assert not any(n.startswith(f"{shm_mod.PREFIX}{pid}-") for n in os.listdir("/dev/shm"))


OWNER = """
import sys, time
from services.kvtransfer import shm
owner = shm.Owner("/dev/shm", pid=int(sys.argv[1]))
segment = shm.Segment("/dev/shm", owner.segment_name(), b"kv" * 1000)
print(segment.name, flush=True)
time.sleep(600)
"""


@pytest.mark.cluster
def test_a_sweep_goes_by_the_owners_lock_not_by_a_pid_from_another_namespace() -> None:
    """Pods sharing the host's /dev/shm each see their own PIDs (every worker is PID 1 of its pod). Until
    2026-12-07 a sweep asked whether the pid in a segment's name was alive here: a killed PID-1 worker's
    segments stayed for good (PID 1 is alive everywhere), and a live worker's whose pid means nothing here
    were swept under its readers. Stand-ins: owners that name themselves PID 1 and a pid no process has."""
    owners = {
        pid: subprocess.Popen([sys.executable, "-c", OWNER, str(pid)], stdout=subprocess.PIPE, text=True)
        for pid in (1, 4_000_000)
    }
    try:
        names = {pid: p.stdout.readline().strip() for pid, p in owners.items() if p.stdout is not None}
        assert all(names.values()) and not os.path.exists("/proc/4000000")
        shm_mod.sweep_orphans("/dev/shm")
        assert all(os.path.exists(f"/dev/shm/{n}") for n in names.values())  # both owners live
        owners[1].kill()
        owners[1].wait()
        shm_mod.sweep_orphans("/dev/shm")
        assert not os.path.exists(f"/dev/shm/{names[1]}") and os.path.exists(f"/dev/shm/{names[4_000_000]}")
        assert not any(
            n.startswith(names[1].rsplit("-", 1)[0]) for n in os.listdir("/dev/shm")
        )  # its lock too
    finally:
        for p in owners.values():
            p.kill()
            p.wait()
        shm_mod.sweep_orphans("/dev/shm")


# --- lifetimes, in one process ---
def own_segments() -> list[str]:
    """This process's shm segments (not the lock files its sources hold)."""
    mine = f"{shm_mod.PREFIX}{os.getpid()}-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(mine) and not n.endswith(".lock")]


def test_ttl_expiry_retracts_and_unlinks_the_shm_segment() -> None:
    async def go() -> None:
        source = await KvSource.start(TransferConfig())
        sink = await KvSink.start(TransferConfig())
        ticket = await source.publish("short-lived", payload(256 * KiB, 1), ttl_s=0.3)
        assert len(own_segments()) == 1
        assert bytes((await sink.pull(ticket, 5.0, backend=SHM)).data) == payload(256 * KiB, 1)
        await asyncio.sleep(0.6)
        assert source.live_keys() == [] and own_segments() == []
        for backend in sink.supported:
            with pytest.raises(TransferNotFound):
                await sink.pull(ticket, 5.0, backend=backend)
        await sink.close()
        await source.close()

    asyncio.run(go())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_publication_counts_as_served_once_a_reader_has_pulled_it_all(backend: str) -> None:
    """What a draining producer waits for (wait_served): KV handed out and not yet read keeps it; a finished
    pull or a retraction releases it, and a pull that never finishes does not count."""

    async def go() -> tuple[list[str], list[str], list[str], list[str]]:
        source = await KvSource.start(TransferConfig())
        sink = await KvSink.start(TransferConfig())
        read, dropped = [
            await source.publish(k, payload(1 * MiB, i), ttl_s=30) for i, k in enumerate(("a", "b"))
        ]
        waited = await source.wait_served(0.3)
        assert bytes((await sink.pull(read, 5.0, backend=backend)).data) == payload(1 * MiB, 0)
        for _ in range(100):  # the reader's "done" reaches the source just after the pull returns
            if "a" not in source.unserved():
                break
            await asyncio.sleep(0.02)
        after_pull = source.unserved()
        source.retract(dropped.key)
        after_retract = await source.wait_served(1.0)
        stalled = await source.publish("c", payload(2 * MiB, 2), ttl_s=30)
        source._test_stall_after_bytes = 1 * MiB
        with pytest.raises(TransferTimeout):
            await sink.pull(stalled, 0.5, backend=TCP)
        await asyncio.sleep(0.2)
        after_stall = source.unserved()
        await sink.close()
        await source.close()
        return waited, after_pull, after_retract, after_stall

    waited, after_pull, after_retract, after_stall = asyncio.run(go())
    assert waited == ["a", "b"]
    assert after_pull == ["b"]
    assert after_retract == []
    assert after_stall == ["c"]


def _frozen_reader_main(ticket_json: str, started: Any) -> None:
    """A decode worker's pull with a deadline far off, in a process of its own (the test SIGSTOPs it)."""

    async def go() -> None:
        sink = await KvSink.start(TransferConfig(socket_buffer_bytes=64 * KiB))
        started.set()
        await sink.pull(TransferTicket.from_json(ticket_json), 600.0, backend=TCP)

    asyncio.run(go())


@starts_processes
def test_a_reader_that_stops_reading_loses_its_pin_after_max_pin_s() -> None:
    """A decode worker frozen mid-pull (SIGSTOP: its connection open, nothing read) must not hold the producer's
    memory for good: the payload's send gives up after max_pin_s, so a retracted publication is freed then.
    Until 2026-12-07 the send had no deadline, and the memory stayed until the reader closed."""
    ctx = mp.get_context("spawn")

    async def go() -> tuple[list[str], list[str], float]:
        config = TransferConfig(max_pin_s=2.0, socket_buffer_bytes=64 * KiB)  # shm too: a segment to watch
        source = await KvSource.start(config)
        opened = asyncio.Event()
        source.debug_on_pull = lambda key: opened.set()
        ticket = await source.publish("frozen", payload(64 * MiB, 4), ttl_s=600)
        started = ctx.Event()
        reader = ctx.Process(target=_frozen_reader_main, args=(ticket.to_json(), started), daemon=True)
        reader.start()
        try:
            await asyncio.to_thread(started.wait, 60)
            async with asyncio.timeout(60):
                await opened.wait()
            os.kill(reader.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            t0 = time.monotonic()
            source.retract("frozen")
            held = own_segments()  # the frozen reader still pins it
            while own_segments() and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.1)
            return held, own_segments(), time.monotonic() - t0
        finally:
            os.kill(reader.pid, signal.SIGKILL)  # type: ignore[arg-type]
            reader.join(10)
            await source.close()

    held, after, freed_after_s = asyncio.run(go())
    assert len(held) == 1  # retracted while pinned: not freed at once
    assert after == []  # freed while the reader was still frozen, its connection still open
    assert freed_after_s >= 1.0  # by the pin's deadline (2 s), not by the retraction itself


def test_a_slow_reader_that_keeps_reading_gets_the_whole_payload() -> None:
    """max_pin_s bounds a reader's lack of progress, not the transfer: a reader taking 8x max_pin_s over a
    16 MiB payload, never stopping for long, still gets every byte."""
    from services.kvtransfer import protocol
    from services.kvtransfer.control import Open

    async def go() -> tuple[int, int]:
        config = TransferConfig(backends=(TCP,), max_pin_s=0.5, tcp_chunk_bytes=256 * KiB,
                                socket_buffer_bytes=64 * KiB)  # fmt: skip
        source = await KvSource.start(config)
        data = payload(16 * MiB, 5)
        ticket = await source.publish("slow", data, ttl_s=60)
        host, port = source.endpoint.rsplit(":", 1)

        def read_slowly() -> int:
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
                sock.sendall(protocol.encode(Open("slow", ticket.serial, TCP, False, False)))
                got, started = 0, time.monotonic()
                while got <= len(data) and time.monotonic() - started < 30:
                    part = sock.recv(64 * KiB)
                    if not part:
                        break
                    got += len(part)
                    time.sleep(0.015)  # ~4 MB/s: 16 MiB in ~4 s, 8x max_pin_s
                return got

        got = await asyncio.to_thread(read_slowly)
        await source.close()
        return got, len(data)

    got, size = asyncio.run(go())
    assert got > size  # the grant's header, then every byte of the payload


def test_retract_during_a_pull_frees_only_after_the_reader_is_done() -> None:
    async def go() -> None:
        source = await KvSource.start(TransferConfig())
        source._test_stall_after_bytes = 1 * MiB
        sink = await KvSink.start(TransferConfig())
        ticket = await source.publish("pinned", payload(2 * MiB, 3), ttl_s=30)
        task = asyncio.create_task(sink.pull(ticket, 0.5, backend=TCP))
        await asyncio.sleep(0.2)
        source.retract("pinned")
        assert source.live_keys() == [] and len(own_segments()) == 1  # a reader still holds it
        with pytest.raises(TransferTimeout):
            await task
        await asyncio.sleep(0.2)  # the reader's connection closes; the source frees on the unpin
        assert own_segments() == []
        await sink.close()
        await source.close()

    asyncio.run(go())


class HeldChecksum:
    """Stops a publish at its checksum until released: where the publish runs is then visible. Were it run on
    the loop, the loop would be stuck in `wait` and nothing else could happen till the deadline."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        real = source_mod.checksum_of

        def held(view: memoryview, kind: str) -> str:
            self.entered.set()
            if not self.release.wait(10.0):
                raise AssertionError("nothing released the publish: it held the loop")
            return real(view, kind)

        monkeypatch.setattr(source_mod, "checksum_of", held)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 10.0), "the publish never reached its checksum"


def test_a_publish_being_prepared_leaves_the_loop_serving_pulls(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        source = await KvSource.start(TransferConfig())
        sink = await KvSink.start(TransferConfig())
        ready = await source.publish("ready", payload(1 * MiB, 1), ttl_s=30)
        hold = HeldChecksum(monkeypatch)
        slow = asyncio.create_task(source.publish("slow", payload(2 * MiB, 2), ttl_s=30))
        await hold.wait_entered()
        for backend in sink.supported:  # served while "slow" is mid-publish
            assert bytes((await sink.pull(ready, 5.0, backend=backend)).data) == payload(1 * MiB, 1)
        with pytest.raises(ValueError, match="already published"):  # its key is taken from the start
            await source.publish("slow", payload(1 * KiB, 3), ttl_s=30)
        assert source.live_keys() == ["ready"]  # not pullable till it is whole
        hold.release.set()
        ticket = await slow
        assert ticket.expires_unix_ms > time.time() * 1000
        for backend in sink.supported:
            assert bytes((await sink.pull(ticket, 5.0, backend=backend)).data) == payload(2 * MiB, 2)
        await sink.close()
        await source.close()
        assert own_segments() == []

    asyncio.run(go())


@pytest.mark.parametrize("how", ["retract", "cancel", "close"])
def test_a_publish_withdrawn_while_prepared_publishes_nothing_and_frees_it(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    async def go() -> None:
        source = await KvSource.start(TransferConfig())
        hold = HeldChecksum(monkeypatch)
        task = asyncio.create_task(source.publish("late", payload(2 * MiB, 4), ttl_s=30))
        await hold.wait_entered()
        assert len(own_segments()) == 1  # the segment is written before the checksum
        closing = None
        if how == "retract":
            source.retract("late")
        elif how == "cancel":
            task.cancel()
        else:
            closing = asyncio.create_task(source.close())
            await asyncio.sleep(0.05)
        hold.release.set()
        expected: type[BaseException] = asyncio.CancelledError if how == "cancel" else RuntimeError
        with pytest.raises(expected):
            await task
        if closing is not None:
            await closing
        for _ in range(100):  # a cancelled publish's thread finishes, then the loop frees what it made
            if not own_segments():
                break
            await asyncio.sleep(0.02)
        assert own_segments() == []
        assert source.live_keys() == []
        if how != "close":
            assert (await source.publish("late", payload(1 * KiB, 5), ttl_s=30)).size == 1 * KiB  # key free
            await source.close()

    asyncio.run(go())


def test_control_connection_serves_consecutive_pulls_and_a_closed_idle_one_is_replaced() -> None:
    async def go() -> None:
        source = await KvSource.start(TransferConfig(backends=(TCP,), control_idle_s=0.3))
        sink = await KvSink.start(TransferConfig(backends=(TCP,)))  # keeps its idle connections far longer
        ticket = await source.publish("again", payload(64 * KiB, 4), ttl_s=30)
        for _ in range(3):
            assert bytes((await sink.pull(ticket, 5.0)).data) == payload(64 * KiB, 4)
        assert len(source._conns) == 1  # one connection served all three pulls
        await asyncio.sleep(0.8)  # the producer closes it as idle; the sink still holds its end
        assert len(source._conns) == 0
        assert bytes((await sink.pull(ticket, 5.0)).data) == payload(64 * KiB, 4)
        await sink.close()
        await source.close()

    asyncio.run(go())


def test_concurrent_pulls_on_one_sink_each_get_their_own_bytes() -> None:
    async def go() -> None:
        source = await KvSource.start(TransferConfig())
        sink = await KvSink.start(TransferConfig(nixl_chunk_bytes=1 * MiB))
        # published at once too: the publishing threads prepare them side by side
        tickets = await asyncio.gather(
            *(source.publish(f"c{i}", payload(3 * MiB + i, 30 + i), ttl_s=30) for i in range(4))
        )
        assert len({t.serial for t in tickets}) == 4
        for backend in sink.supported:  # four at once per backend: chunked NIXL reads interleave on one agent
            got = await asyncio.gather(*(sink.pull(t, 10.0, backend=backend) for t in tickets))
            assert [bytes(g.data) for g in got] == [payload(3 * MiB + i, 30 + i) for i in range(4)]
        await sink.close()
        await source.close()

    asyncio.run(go())


def test_close_frees_every_publication() -> None:
    async def go() -> None:
        source = await KvSource.start(TransferConfig())
        for i in range(3):
            await source.publish(f"k{i}", payload(64 * KiB, i), ttl_s=30)
        assert len(own_segments()) == 3
        await source.close()
        assert own_segments() == []

    asyncio.run(go())


# --- choosing a backend ---
def test_choose_backend_prefers_shm_on_one_node_then_nixl_then_tcp() -> None:
    pref = [SHM, NIXL, TCP]
    everything = {TCP: "h:1", SHM: "node-a", NIXL: "agent"}
    assert choose_backend(pref, everything, [TCP, SHM, NIXL], same_node=True) == SHM
    assert choose_backend(pref, everything, [TCP, SHM, NIXL], same_node=False) == NIXL
    assert choose_backend(pref, {TCP: "h:1", SHM: "node-a"}, [TCP, SHM, NIXL], same_node=False) == TCP
    assert choose_backend(pref, everything, [TCP, SHM], same_node=False) == TCP
    assert choose_backend([TCP, NIXL], everything, [TCP, SHM, NIXL], same_node=True) == TCP


def test_sink_chooses_shm_for_a_producer_on_its_node(producer: Producer) -> None:
    ticket = producer.publish("choose", 1 * KiB)

    async def go() -> tuple[str, str]:
        sink = await KvSink.start(TransferConfig())
        try:
            far = dataclasses.replace(ticket, backends={**ticket.backends, SHM: "another-node"})
            return sink.choose(ticket), sink.choose(far)
        finally:
            await sink.close()

    near, far = asyncio.run(go())
    assert near == SHM and far == (NIXL if HAVE_NIXL else TCP)


# --- wire compression ---
@pytest.mark.parametrize(("method", "max_ratio", "max_rel_err"), [("nvfp4", 0.30, 0.20), ("fp8", 0.27, 0.06)])
def test_compressed_pull_returns_the_dtype_back_within_the_quantization_error(
    method: str, max_ratio: float, max_rel_err: float
) -> None:
    import torch

    kv = torch.randn(4, 2, 16, 64, generator=torch.Generator().manual_seed(0))  # fp32, head_dim 64
    raw = kv.numpy().tobytes()

    async def go() -> Any:
        source = await KvSource.start(TransferConfig(backends=(TCP,)))
        sink = await KvSink.start(TransferConfig(backends=(TCP,)))
        ticket = await source.publish("q", raw, ttl_s=30, compress=method, kv_dtype="fp32", head_dim=64)
        got = await sink.pull(ticket, 5.0)
        await sink.close()
        await source.close()
        return ticket, got

    ticket, got = asyncio.run(go())
    assert ticket.raw_size == len(raw) and ticket.size / len(raw) < max_ratio
    back = torch.frombuffer(got.data, dtype=torch.float32).view_as(kv)
    rel = ((back - kv).norm() / kv.norm()).item()
    assert rel < max_rel_err


@pytest.mark.parametrize("method", ["nvfp4", "fp8"])
def test_the_codec_reads_a_payload_in_place_and_never_writes_it(method: str) -> None:
    import torch

    from services.kvtransfer import codec

    kv = torch.randn(3, 2, 16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    export = bytearray(kv.view(torch.uint8).numpy().tobytes())  # writable, as an export's staged bytes are
    wire = codec.encode(export, method, "bf16", 64)
    assert export == kv.view(torch.uint8).numpy().tobytes()  # the producer's KV is untouched
    assert bytes(codec.encode(bytes(export), method, "bf16", 64)) == bytes(wire)  # read-only input: same wire
    back = codec.decode(bytes(wire), method)  # a read-only pulled payload decodes too
    assert bytes(back) == bytes(codec.decode(bytearray(wire), method))
    assert len(back) == len(export)
    out = torch.frombuffer(back, dtype=torch.bfloat16).view_as(kv).float()
    assert ((out - kv.float()).norm() / kv.float().norm()).item() < 0.2


# --- NIXL pulls that READ before the producer's reply ---
@needs_nixl
@pytest.mark.cluster
def test_eager_nixl_pull_of_a_retracted_or_republished_key_is_not_found_never_stale_bytes() -> None:
    p = Producer(config=TransferConfig(backends=(TCP, NIXL), checksum="none"))  # nothing but size to check
    try:
        gone = p.publish("gone", 4 * MiB, seed=1)
        old = p.publish("reused", 4 * MiB, seed=2)
        assert gone.nixl_addr and gone.serial and gone.serial != old.serial
        p.call("retract", "gone")
        p.call("retract", "reused")
        new = p.publish("reused", 4 * MiB, seed=3)  # same key and size, new bytes

        async def go() -> None:
            sink = await KvSink.start(TransferConfig())
            try:
                assert sink._may_read_eagerly(gone, 20.0)  # the READ starts before the reply
                for stale in (gone, old):
                    with pytest.raises(TransferNotFound):
                        await sink.pull(stale, 20.0, backend=NIXL)
                got = await sink.pull(new, 20.0, backend=NIXL)  # the refused pulls left the sink usable
                assert bytes(got.data) == payload(4 * MiB, 3)
            finally:
                await sink.close()

        asyncio.run(go())
    finally:
        p.stop()


@needs_nixl
def test_nixl_pull_waits_for_the_reply_when_the_ticket_lacks_the_region_or_expires_within_the_deadline(
    producer: Producer,
) -> None:
    ticket = producer.publish("ordered", 3 * MiB, seed=8)
    no_region = dataclasses.replace(ticket, nixl_addr=0)
    short = producer.publish("short-ttl", 3 * MiB, seed=9, ttl_s=2.0)

    async def go() -> None:
        sink = await KvSink.start(TransferConfig())
        try:
            assert not sink._may_read_eagerly(no_region, 20.0) and not sink._may_read_eagerly(short, 20.0)
            # a ticket from a producer older than serials has nothing to tie the eager READ's bytes to
            assert not sink._may_read_eagerly(dataclasses.replace(ticket, serial=""), 20.0)
            assert bytes((await sink.pull(no_region, 20.0, backend=NIXL)).data) == payload(3 * MiB, 8)
            assert bytes((await sink.pull(short, 20.0, backend=NIXL)).data) == payload(3 * MiB, 9)
        finally:
            await sink.close()

    asyncio.run(go())


@needs_nixl
def test_eager_nixl_pull_releases_its_pin_so_a_retract_frees_the_segment() -> None:
    async def go() -> None:
        source = await KvSource.start(TransferConfig())  # tcp, shm, nixl: NIXL reads the shm segment
        sink = await KvSink.start(TransferConfig())
        ticket = await source.publish("pinned-eager", payload(2 * MiB, 6), ttl_s=30)
        assert sink._may_read_eagerly(ticket, 5.0)
        assert bytes((await sink.pull(ticket, 5.0, backend=NIXL)).data) == payload(2 * MiB, 6)
        for _ in range(50):  # the "done" reaches the source's loop
            await asyncio.sleep(0.01)
            if all(pub.pins == 0 for pub in source._pubs.values()):
                break
        source.retract("pinned-eager")
        assert own_segments() == []  # no reader holds it: freed at once
        await sink.close()
        await source.close()

    asyncio.run(go())


def test_checked_nixl_read_ends_in_short_pieces_and_covers_the_payload_once() -> None:
    from services.kvtransfer.sink import read_chunks

    for size, chunk in (
        (64 * MiB, 8 * MiB),
        (5 * MiB + 123, 1 * MiB),
        (3 * MiB, 8 * MiB),
        (8 * MiB, 8 * MiB),
    ):
        pieces = read_chunks(size, chunk)
        assert [o for o, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
        assert sum(n for _, n in pieces) == size and all(0 < n <= chunk for _, n in pieces)
    assert [n // MiB for _, n in read_chunks(64 * MiB, 8 * MiB)] == [8] * 7 + [4, 2, 1, 1]


def test_ticket_from_a_newer_producer_with_unknown_fields_still_parses() -> None:
    ticket = TransferTicket(key="k", size=3, checksum="none", endpoint="127.0.0.1:1", backends={TCP: "x"})
    text = ticket.to_json()[:-1] + ',"field_from_the_future":1}'
    assert TransferTicket.from_json(text) == ticket
    with pytest.raises(ValueError, match="not a transfer ticket"):
        TransferTicket.from_json("[1, 2]")
    # a field of the wrong type is refused at parsing (an AttributeError deep in the pull, an INTERNAL, before)
    for field_name, wrong in (("backends", "x"), ("backends", {TCP: 5}), ("size", "3"), ("size", True)):
        bad = json.loads(ticket.to_json()) | {field_name: wrong}
        with pytest.raises(ValueError, match=field_name):
            TransferTicket.from_json(json.dumps(bad))


# --- NIXL reads of the producer's device copy (VRAM on a GPU; the same code path on host memory here) ---
@needs_nixl
def test_nixl_reads_the_device_copy_raw_into_a_tensor_where_the_caller_keeps_its_kv(
    producer: Producer,
) -> None:
    """A producer whose KV is on a device registers that copy with NIXL beside the wire bytes; a reader whose KV
    lives on the same kind of device READs it straight into a tensor there: every byte as the producer holds it,
    none of the wire's fp8 rounding. A reader elsewhere (or asking for no device) gets the host bytes."""
    import torch

    raw = kv_floats(2 * MiB, seed=4)
    ticket = producer.publish_device("dev", 2 * MiB, seed=4, compress="fp8")
    assert ticket.nixl_device == "cpu" and ticket.encoding == "fp8" and ticket.size < len(raw) // 3
    got = pull(ticket, NIXL, device="cpu")
    assert (
        isinstance(got.data, torch.Tensor) and got.data.dtype == torch.uint8 and got.data.device.type == "cpu"
    )
    assert (
        got.backend == NIXL
        and got.device_direct
        and got.bytes == len(raw)
        and got.data.numpy().tobytes() == raw
    )
    for device in (None, "cuda:0"):  # no device asked for / a device of another kind: the wire bytes
        host = pull(ticket, NIXL, device=device)
        assert (
            not host.device_direct and not isinstance(host.data, torch.Tensor) and len(host.data) == len(raw)
        )
        assert bytes(host.data) != raw  # fp8 on the wire: close, not exact
        back = np.frombuffer(bytes(host.data), dtype=np.float32)
        want = np.frombuffer(raw, dtype=np.float32)
        assert np.linalg.norm(back - want) / np.linalg.norm(want) < 0.06
    assert pull(ticket, TCP, device="cpu").data is not None  # other backends ignore the device


@needs_nixl
def test_a_device_read_of_a_publication_without_a_device_copy_reads_its_host_bytes_and_gone_is_refused(
    producer: Producer,
) -> None:
    plain = producer.publish_device("no-copy", 1 * MiB, seed=5, device="")
    assert plain.nixl_device == ""
    assert bytes(pull(plain, NIXL, device="cpu").data) == kv_floats(1 * MiB, 5)  # host bytes, no device read
    # a ticket claiming a device copy the producer lacks: refused by the producer, read from the host bytes
    lacking = pull(dataclasses.replace(plain, nixl_device="cpu"), NIXL, device="cpu")
    assert not lacking.device_direct and bytes(lacking.data) == kv_floats(1 * MiB, 5)
    gone = producer.publish_device("gone-dev", 1 * MiB, seed=6)
    producer.call("retract", "gone-dev")
    with pytest.raises(TransferNotFound):
        pull(gone, NIXL, device="cpu")
    again = producer.publish_device("gone-dev", 1 * MiB, seed=7)  # same key, a new publication
    with pytest.raises(TransferNotFound):
        pull(gone, NIXL, device="cpu")
    assert pull(again, NIXL, device="cpu").data.numpy().tobytes() == kv_floats(1 * MiB, 7)


@needs_nixl
def test_the_device_copy_goes_once_a_device_reader_has_it_and_later_readers_get_the_host_bytes(
    producer: Producer,
) -> None:
    """A GPU producer's device copy sits in GPU memory outside its cache's plan, and the publication lives until
    the decode worker's Release (minutes of decoding): kept that long, every request in flight would hold its KV
    twice on the prefill GPU. It goes as soon as a device reader has finished; a later reader (a migration's
    re-pull) reads the host bytes, which stay published, and gets the same payload."""
    raw = kv_floats(2 * MiB, seed=9)
    ticket = producer.publish_device("once", 2 * MiB, seed=9)
    first = pull(ticket, NIXL, device="cpu")
    assert first.device_direct and first.data.numpy().tobytes() == raw
    again = pull(ticket, NIXL, device="cpu")  # the device copy is gone: the host bytes, the same payload
    assert not again.device_direct and bytes(again.data) == raw
    assert bytes(pull(ticket, TCP).data) == raw


@needs_nixl
@pytest.mark.cluster
def test_device_copies_past_the_budget_are_offered_as_host_bytes_and_room_returns_once_one_is_read() -> None:
    """A producer keeps device copies only within --kv-device-copy-bytes (the room its GPU's KV plan left for
    them): a publication past it is offered as host bytes alone, which its device readers then get, the same
    payload; once a device reader has finished with a kept copy, its room takes the next publication's."""
    p = Producer(config=TransferConfig(device_copy_bytes=3 * MiB))
    try:
        kept = p.publish_device("kept", 2 * MiB, seed=11)
        assert kept.nixl_device == "cpu"
        over = p.publish_device("over", 2 * MiB, seed=12)  # 4 MiB of copies would not fit in 3
        assert over.nixl_device == ""
        got = pull(over, NIXL, device="cpu")
        assert not got.device_direct and bytes(got.data) == kv_floats(2 * MiB, 12)
        first = pull(kept, NIXL, device="cpu")  # its device copy goes once read: its room with it
        assert first.device_direct and first.data.numpy().tobytes() == kv_floats(2 * MiB, 11)
        after = p.publish_device("after", 2 * MiB, seed=13)
        assert after.nixl_device == "cpu"
        assert pull(after, NIXL, device="cpu").data.numpy().tobytes() == kv_floats(2 * MiB, 13)
    finally:
        p.stop()


def test_device_room_is_reserved_before_the_copy_and_goes_back_once_whatever_happens() -> None:
    """A prefill worker reserves a device copy's room before it makes the copy, so copies being made count
    against --kv-device-copy-bytes too (prompts finishing together would otherwise each see room for one and
    all gather a copy). Given back once however often it is given; a publication that keeps no device copy
    gives it back itself."""
    import torch

    async def go() -> None:
        src = await KvSource.start(TransferConfig(backends=(TCP, "cuda_ipc"), device_copy_bytes=3 * MiB))
        try:
            first = src.device_room(2 * MiB)
            assert first is not None and src.device_bytes_held() == 2 * MiB
            assert src.device_room(2 * MiB) is None  # the copy being made holds its room
            first.give()
            first.give()
            assert src.device_bytes_held() == 0
            room = src.device_room(2 * MiB)
            assert room is not None
            host_only = torch.zeros(2 * MiB, dtype=torch.uint8)  # no reader here reads host memory directly
            ticket = await src.publish("k", bytes(2 * MiB), 10.0, device_payload=host_only, device_room=room)
            assert "cuda_ipc" not in ticket.backends and src.device_bytes_held() == 0
            room.give()  # a caller's give after the publication gave it: nothing more
            assert src.device_bytes_held() == 0
        finally:
            await src.close()
        none = await KvSource.start(TransferConfig(backends=(TCP, SHM)))  # no device-direct reader at all
        try:
            assert none.device_room(1) is None
        finally:
            await none.close()

    asyncio.run(go())


@needs_nixl
def test_device_direct_pulls_stay_within_their_budget_until_their_holder_drops_them(
    producer: Producer,
) -> None:
    """A decode worker's device-direct pull lands in device memory outside its KV cache's plan, until the engine
    has written it into its blocks: pulls count against --kv-device-pull-bytes (the room the plan left) from the
    pull until the last holder drops the tensor, and a pull past it reads the host bytes, the same payload. The
    sink counts what its pulls still hold, host and device (rackserve_kv_pulled_resident_bytes)."""
    import gc

    tickets = [producer.publish_device(f"budget-{i}", 2 * MiB, seed=20 + i) for i in range(3)]

    async def go() -> None:
        sink = await KvSink.start(TransferConfig(device_pull_bytes=3 * MiB))
        try:
            first = await sink.pull(tickets[0], 20.0, backend=NIXL, device="cpu")
            assert first.device_direct and first.data.numpy().tobytes() == kv_floats(2 * MiB, 20)
            assert sink.device_bytes_held() == 2 * MiB and sink.resident_bytes("device") == 2 * MiB
            # 4 MiB of device pulls would not fit in 3: the host bytes, whole
            second = await sink.pull(tickets[1], 20.0, backend=NIXL, device="cpu")
            assert not second.device_direct and bytes(second.data) == kv_floats(2 * MiB, 21)
            assert sink.device_bytes_held() == 2 * MiB and sink.resident_bytes("host") == 2 * MiB
            kept = first.data
            del first  # the Pulled goes; whoever holds the tensor (the engine) still counts
            gc.collect()
            assert sink.device_bytes_held() == 2 * MiB
            del kept, second
            # a NIXL read's buffer goes when its completion callback has run, on the loop's next turn
            for _ in range(200):
                gc.collect()
                if sink.resident_bytes("host") == 0:
                    break
                await asyncio.sleep(0.01)
            assert sink.device_bytes_held() == 0
            assert sink.resident_bytes("device") == 0 and sink.resident_bytes("host") == 0
            third = await sink.pull(tickets[2], 20.0, backend=NIXL, device="cpu")  # the room is back
            assert third.device_direct and third.data.numpy().tobytes() == kv_floats(2 * MiB, 22)
        finally:
            await sink.close()

    asyncio.run(go())


@needs_nixl
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_nixl_reads_vram_gpu_to_gpu(producer: Producer) -> None:
    """Where NIXL and a GPU meet: the producer's copy in VRAM, READ into the reader's VRAM."""
    ticket = producer.publish_device("vram", 8 * MiB, seed=8, compress="fp8", device="cuda:0")
    assert ticket.nixl_device == "cuda:0"
    got = pull(ticket, NIXL, device="cuda:0")
    assert got.data.is_cuda and got.data.cpu().numpy().tobytes() == kv_floats(8 * MiB, 8)


@pytest.mark.parametrize("huge_on_advice", [False, True])
def test_a_segment_holds_the_payload_whichever_way_the_kernel_wants_it_filled(
    monkeypatch: pytest.MonkeyPatch, huge_on_advice: bool
) -> None:
    """By write(2), or (where tmpfs gives huge pages only to a mapping that asks) through an advised mapping:
    either way a reader copies out exactly the payload, of any size, and the name goes with close()."""
    monkeypatch.setattr(shm_mod, "_tmpfs_huge_on_advice", lambda: huge_on_advice)
    for size in (0, 1, 4097, 3 * MiB + 5):
        data = payload(size, size)
        seg = shm_mod.Segment(
            "/dev/shm", f"{shm_mod.PREFIX}{os.getpid()}-{size:x}{int(huge_on_advice)}", data
        )
        try:
            assert bytes(seg.view()) == data
            out = bytearray(size)
            shm_mod.copy_out("/dev/shm", seg.name, memoryview(out))
            assert bytes(out) == data
        finally:
            seg.close()
        assert not os.path.exists(seg.path)


class _FakeDeviceCopy:
    """What KvSource reads of a device payload before a cuda_ipc reader opens it (no GPU here: the share and the
    consumer's mapping below are stand-ins; the source, sink, sockets and protocol are the real ones)."""

    is_cuda = True

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1

    def is_contiguous(self) -> bool:
        return True


@pytest.mark.parametrize("failure", ["consumer_open", "producer_share", "cpu_reader"])
def test_a_cuda_ipc_share_is_made_per_reader_at_its_open_and_any_failure_falls_back_to_host_bytes(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """torch counts every cuda_ipc share until a reader's mapping of it goes, keeping the device copy until
    then: a share made at publication stayed on the GPU for good whenever no cuda_ipc reader came. Now nothing is
    shared at publication, one share goes in each cuda_ipc reader's grant, and a share that fails, a driver error
    in the reader's open, or a reader whose KV is on the CPU all end in the host bytes, whole."""
    from services.kvtransfer import cuda_ipc
    from services.kvtransfer import sink as sink_mod

    shares: list[int] = []

    def describe(copy: Any) -> dict[str, Any]:
        if failure == "producer_share":
            raise RuntimeError("cudaMallocAsync does not yet support shareIpcHandle")
        shares.append(copy.nbytes)
        return {"fake": True}

    def open_described(desc: dict[str, Any]) -> Any:
        raise RuntimeError("CUDA error: invalid device context")  # what a failing cudaIpcOpenMemHandle raises

    monkeypatch.setattr(cuda_ipc, "describe", describe)
    monkeypatch.setattr(cuda_ipc, "open_described", open_described)
    monkeypatch.setattr(sink_mod, "_cuda_visible", lambda: True)
    data = payload(MiB, 31)

    async def go() -> None:
        src = await KvSource.start(TransferConfig(backends=(TCP, CUDA_IPC), device_copy_bytes=4 * MiB))
        sink = await KvSink.start(TransferConfig(backends=(TCP, CUDA_IPC)))
        try:
            ticket = await src.publish("ipc", data, 10.0, device_payload=_FakeDeviceCopy(MiB))
            assert ticket.backends[CUDA_IPC] and shares == []  # offered, not yet shared
            got = await sink.pull(ticket, 10.0, device="cpu" if failure == "cpu_reader" else "cuda:0")
            assert got.backend == TCP and not got.device_direct and bytes(got.data) == data
            assert shares == ([MiB] if failure == "consumer_open" else [])
        finally:
            await sink.close()
            await src.close()

    asyncio.run(go())
