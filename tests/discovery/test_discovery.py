"""Discovery against a real etcd: registrations, leases, watches, and what happens when etcd or a worker dies.

Every test starts its own etcd (tests/support/etcd.py); worker processes are real subprocesses killed with real
signals. Time bounds here are behavioural deadlines from docs/design.md, "Discovery" (a graceful exit is seen at
once, a crash within the lease TTL), not performance measurements.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import aetcd
import pytest

from services.discovery import (
    DiscoveryTimeoutError,
    EtcdUnavailableError,
    Registration,
    WorkerDirectory,
    parse_etcd_url,
    parse_etcd_urls,
    worker_key,
)
from services.rpc import pb
from tests.support.etcd import EtcdServer, free_port
from tests.support.etcd import etcd_server as etcd_server  # the fixture; `as` marks it used for ruff
from tests.support.paths import REPO

REPO_ROOT = str(REPO)
pytestmark = pytest.mark.cluster  # starts etcd and worker processes
TTL_S = 2.0
T = TypeVar("T")

# A worker process: registers, says so, and on SIGTERM deregisters gracefully before exiting.
WORKER_SCRIPT = """
import asyncio, signal, sys
from services.discovery import Registration
from services.rpc import pb

async def main(url, worker_id, ttl_s):
    info = pb.WorkerInfo(worker_id=worker_id, role="prefill", endpoint="127.0.0.1:50051", epoch=1)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    reg = await Registration.start(url, info, ttl_s=ttl_s)
    print("registered" if reg.registered else "not registered", flush=True)
    await stop.wait()
    await reg.close()

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


def run(body: Awaitable[T], timeout_s: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(body, timeout_s)

    return asyncio.run(bounded())


def worker_info(worker_id: str, role: str = "decode") -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=worker_id,
        role=role,
        endpoint="10.0.0.7:50051",
        transfer_endpoint="10.0.0.7:7000",
        model_fingerprint="sha256:abc123",
        model_name="SmolLM2-135M-Instruct",
        kv_capacity_blocks=4096,
        block_size=16,
        topology={"node": "n1", "rack": "r1", "zone": "z1"},
        epoch=1_700_000_000_123,
        max_model_len=8192,
        kv_dtype="bf16",
    )


def ids(workers: list[pb.WorkerInfo]) -> list[str]:
    return [w.worker_id for w in workers]


async def eventually(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until `condition()` held; AssertionError naming `what` if it did not within `timeout_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not condition():
        if loop.time() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.02)
    return loop.time() - start


@asynccontextmanager
async def worker_process(url: str, worker_id: str) -> AsyncIterator[subprocess.Popen[str]]:
    """A worker subprocess that has registered (it says so on stdout before this yields)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER_SCRIPT, url, worker_id, str(TTL_S)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "registered"
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


async def started_directory(url: str, roles: tuple[str, ...] = ("prefill", "decode")) -> WorkerDirectory:
    d = WorkerDirectory(url, roles=roles)
    await d.start()
    return d


def test_parse_etcd_url_accepts_urls_host_port_and_lists() -> None:
    assert parse_etcd_url("http://127.0.0.1:2379") == ("127.0.0.1", 2379)
    assert parse_etcd_url("127.0.0.1:2380") == ("127.0.0.1", 2380)
    assert parse_etcd_url("etcd.local") == ("etcd.local", 2379)
    assert parse_etcd_urls("http://a:1, b:2") == [("a", 1), ("b", 2)]
    assert parse_etcd_url("http://a:1,http://b:2") == ("a", 1)
    assert parse_etcd_url("https://a:2379") == ("a", 2379)  # TLS: services.discovery.etcd.EtcdSecurity
    with pytest.raises(ValueError, match="https://"):
        parse_etcd_url("unix://a:2379")
    assert worker_key("decode", "d-1") == "/rackserve/v1/workers/decode/d-1"
    with pytest.raises(ValueError, match="role"):
        worker_key("gpu", "x")


def test_registered_worker_is_listed_with_all_fields_and_graceful_close_removes_it_at_once(
    etcd_server: EtcdServer,
) -> None:
    async def body() -> None:
        # The first endpoint of the list is dead: the directory must use the next reachable one.
        d = await started_directory(f"http://127.0.0.1:{free_port()},{etcd_server.url}")
        events: list[tuple[str, str]] = []
        d.subscribe(lambda kind, info: events.append((kind, info.worker_id)))
        info = worker_info("d-1")
        reg = await Registration.start(etcd_server.url, info, ttl_s=TTL_S)
        assert reg.registered
        assert ids(await d.wait_for("decode", 1, timeout_s=5)) == ["d-1"]
        assert d.get("d-1") == info  # every field, topology included, survives the round trip
        assert d.workers("prefill") == []

        closing = asyncio.get_running_loop().time()
        await reg.close()
        await eventually(lambda: d.get("d-1") is None, 0.5 - (asyncio.get_running_loop().time() - closing),
                         "a gracefully closed worker leaves the view")  # fmt: skip
        assert not reg.registered
        assert events == [("added", "d-1"), ("removed", "d-1")]
        await d.close()

    run(body())


def test_closing_an_old_instance_leaves_a_newer_instance_under_the_same_worker_id(
    etcd_server: EtcdServer,
) -> None:

    async def body() -> None:
        d = await started_directory(etcd_server.url)
        events: list[tuple[str, int]] = []
        d.subscribe(lambda kind, info: events.append((kind, info.epoch)))
        old = await Registration.start(etcd_server.url, worker_info("d-1"), ttl_s=TTL_S)
        await d.wait_for("decode", 1, timeout_s=5)
        restarted = worker_info("d-1")
        restarted.epoch += 1
        new = await Registration.start(etcd_server.url, restarted, ttl_s=TTL_S)
        await eventually(lambda: len(events) == 3, 1, "the restart is seen as removed + added")
        assert events == [
            ("added", restarted.epoch - 1),
            ("removed", restarted.epoch - 1),
            ("added", restarted.epoch),
        ]

        await old.close()
        await asyncio.sleep(0.3)
        current = d.get("d-1")
        assert current is not None and current.epoch == restarted.epoch
        await new.close()
        await d.close()

    run(body())


def test_a_worker_whose_namesake_stops_is_listed_again_within_a_refresh(etcd_server: EtcdServer) -> None:
    # two processes under one worker id (two `rackserve up` on one etcd both name a worker decode-0): the second
    # takes the key; when it stops, the first, still running and renewing its lease, must not stay unlisted

    async def body() -> None:
        d = await started_directory(etcd_server.url)
        first = await Registration.start(etcd_server.url, worker_info("d-1"), ttl_s=TTL_S)
        await d.wait_for("decode", 1, timeout_s=5)

        def epoch() -> int | None:
            listed = d.get("d-1")
            return listed.epoch if listed is not None else None

        namesake = worker_info("d-1")
        namesake.epoch, namesake.endpoint = namesake.epoch + 1, "10.0.0.8:50051"
        second = await Registration.start(etcd_server.url, namesake, ttl_s=TTL_S)
        await eventually(lambda: epoch() == namesake.epoch, 2, "second")
        await asyncio.sleep(TTL_S)
        # while the second runs, the first leaves it the key
        assert epoch() == namesake.epoch
        await second.close()
        await eventually(
            lambda: epoch() == namesake.epoch - 1, TTL_S, "the first listed again after the second stopped"
        )
        await first.close()
        await eventually(lambda: d.get("d-1") is None, 1, "gone once both stopped")
        await d.close()

    run(body())


def test_sigkilled_worker_process_disappears_within_ttl(etcd_server: EtcdServer) -> None:
    async def body() -> None:
        d = await started_directory(etcd_server.url)
        async with worker_process(etcd_server.url, "p-kill") as proc:
            await d.wait_for("prefill", 1, timeout_s=15)
            proc.kill()
            await eventually(lambda: d.get("p-kill") is None, TTL_S + 1, "a SIGKILLed worker's lease expires")
        await d.close()

    run(body())


def test_sigtermed_worker_process_deregisters_and_disappears_at_once(etcd_server: EtcdServer) -> None:
    async def body() -> None:
        d = await started_directory(etcd_server.url)
        async with worker_process(etcd_server.url, "p-term") as proc:
            await d.wait_for("prefill", 1, timeout_s=15)
            proc.terminate()
            await eventually(lambda: d.get("p-term") is None, 0.5 + 0.5, "a SIGTERMed worker deletes its key")
            assert await asyncio.to_thread(proc.wait, 5) == 0
        await d.close()

    run(body())


def test_etcd_restart_freezes_the_view_then_reconciles_and_watches_again(etcd_server: EtcdServer) -> None:
    async def body() -> None:
        reg = await Registration.start(etcd_server.url, worker_info("d-1"), ttl_s=TTL_S)
        d = await started_directory(etcd_server.url)
        await d.wait_for("decode", 1, timeout_s=5)

        await asyncio.to_thread(etcd_server.stop)
        await eventually(lambda: not d.connected, 3, "the directory notices etcd is gone")
        await asyncio.sleep(1.0)
        assert ids(d.workers("decode")) == ["d-1"]  # frozen, not emptied
        assert not d.connected

        await asyncio.to_thread(etcd_server.start)
        await eventually(lambda: d.connected, 5, "the directory reconnects")
        await eventually(lambda: reg.registered, 5, "the registration renews its lease again")
        fresh = await started_directory(etcd_server.url)  # what etcd itself holds now, not a remembered view
        assert ids(fresh.workers("decode")) == ["d-1"]

        other = await Registration.start(etcd_server.url, worker_info("d-2"), ttl_s=TTL_S)
        assert ids(await d.wait_for("decode", 2, timeout_s=5)) == ["d-1", "d-2"]
        for closable in (other, reg, fresh, d):
            await closable.close()

    run(body())


def test_lease_lost_while_etcd_hung_longer_than_ttl_is_registered_again(etcd_server: EtcdServer) -> None:
    async def body() -> None:
        reg = await Registration.start(etcd_server.url, worker_info("d-1"), ttl_s=TTL_S)
        d = await started_directory(etcd_server.url)
        await d.wait_for("decode", 1, timeout_s=5)
        lost_lease = reg.lease_id

        # A hung etcd keeps its sockets open and answers nothing; its clock runs on, so the lease expires.
        etcd_server.pause()
        await eventually(lambda: not d.connected, 3, "the directory's probe notices the hung etcd")
        await eventually(lambda: not reg.registered, TTL_S + 1, "the registration knows it is not renewed")
        await asyncio.sleep(0.5)
        assert ids(d.workers("decode")) == ["d-1"]  # frozen

        etcd_server.resume()
        await eventually(lambda: reg.registered and reg.lease_id != lost_lease, 5, "a new lease is granted")
        async with aetcd.Client("127.0.0.1", etcd_server.client_port, timeout=2) as client:
            stored = await client.get(worker_key("decode", "d-1").encode())
        assert stored is not None and stored.lease == reg.lease_id  # the key was put again, on the new lease
        # The directory may have re-listed between the expiry and the new put; its watch brings the put.
        await d.wait_for("decode", 1, timeout_s=5)
        assert d.connected
        await reg.close()
        await d.close()

    run(body())


def test_hung_worker_process_vanishes_with_its_lease_and_comes_back_when_it_resumes(
    etcd_server: EtcdServer,
) -> None:
    async def body() -> None:
        d = await started_directory(etcd_server.url)
        async with worker_process(etcd_server.url, "p-hung") as proc:
            await d.wait_for("prefill", 1, timeout_s=15)
            proc.send_signal(signal.SIGSTOP)
            await eventually(lambda: d.get("p-hung") is None, TTL_S + 1, "a hung worker's lease expires")
            proc.send_signal(signal.SIGCONT)
            await d.wait_for("prefill", 1, timeout_s=5)  # it grants a new lease and puts its key back
        await d.close()

    run(body())


def test_registration_started_while_etcd_is_down_registers_once_it_is_up(tmp_path: str) -> None:
    async def body(etcd: EtcdServer) -> None:
        reg = await Registration.start(etcd.url, worker_info("d-1"), ttl_s=TTL_S)
        assert not reg.registered  # no exception: a worker never crashes for want of etcd
        await asyncio.to_thread(etcd.start)
        await eventually(lambda: reg.registered, 5, "registered once etcd is up")
        d = await started_directory(etcd.url)
        assert ids(d.workers("decode")) == ["d-1"]
        await reg.close()
        await d.close()

    etcd = EtcdServer(data_dir=str(tmp_path))
    try:
        run(body(etcd))
    finally:
        etcd.close()


def test_suppressed_worker_is_hidden_at_once_and_reappears_after_the_suppression(
    etcd_server: EtcdServer,
) -> None:
    async def body() -> None:
        regs = [
            await Registration.start(etcd_server.url, worker_info(w), ttl_s=TTL_S) for w in ("d-1", "d-2")
        ]
        d = await started_directory(etcd_server.url)
        await d.wait_for("decode", 2, timeout_s=5)
        events: list[tuple[str, str]] = []
        d.subscribe(lambda kind, info: events.append((kind, info.worker_id)))

        d.suppress("d-1", 0.5)
        assert ids(d.workers("decode")) == ["d-2"]
        assert d.get("d-1") is None
        assert events == [("removed", "d-1")]

        await eventually(lambda: ids(d.workers("decode")) == ["d-1", "d-2"], 2, "d-1 is visible again")
        assert d.get("d-1") is not None
        assert events == [("removed", "d-1"), ("added", "d-1")]
        for reg in regs:
            await reg.close()
        await d.close()

    run(body())


def test_a_suppressed_process_does_not_hide_the_one_that_replaces_it_under_its_id(
    etcd_server: EtcdServer,
) -> None:
    """A failure report names the failed process's epoch: a restart under the same id is visible at once, and a
    report that arrives after the restart hides nothing."""

    def info(epoch: int) -> pb.WorkerInfo:
        w = worker_info("d-1")
        w.epoch = epoch
        return w

    async def body() -> None:
        old = await Registration.start(etcd_server.url, info(1), ttl_s=TTL_S)
        d = await started_directory(etcd_server.url)
        await d.wait_for("decode", 1, timeout_s=5)
        events: list[tuple[str, int]] = []
        d.subscribe(lambda kind, w: events.append((kind, w.epoch)))
        d.suppress("d-1", 30.0, epoch=1)
        assert d.workers("decode") == [] and events == [("removed", 1)]
        await old.close()
        new = await Registration.start(etcd_server.url, info(2), ttl_s=TTL_S)
        await eventually(
            lambda: [w.epoch for w in d.workers("decode")] == [2], 5, "the new process is visible"
        )
        assert events == [("removed", 1), ("added", 2)]
        d.suppress("d-1", 30.0, epoch=1)  # a late report about the old process
        assert [w.epoch for w in d.workers("decode")] == [2] and events == [("removed", 1), ("added", 2)]
        d.suppress("d-1", 30.0, epoch=2)  # the new one fails too
        assert d.workers("decode") == [] and events[-1] == ("removed", 2)
        await new.close()
        await d.close()

    run(body())


def test_wait_for_times_out_with_an_error_naming_role_count_and_what_is_visible(
    etcd_server: EtcdServer,
) -> None:
    async def body() -> None:
        reg = await Registration.start(etcd_server.url, worker_info("d-1"), ttl_s=TTL_S)
        d = await started_directory(etcd_server.url)
        with pytest.raises(
            DiscoveryTimeoutError, match=r"waited 0.3s for 2 decode worker\(s\).*1 visible \(d-1\)"
        ):
            await d.wait_for("decode", 2, timeout_s=0.3)
        await reg.close()
        await d.close()

    run(body())


def test_directory_start_fails_clearly_when_etcd_is_unreachable() -> None:
    async def body() -> None:
        d = WorkerDirectory(f"http://127.0.0.1:{free_port()}", connect_timeout_s=0.5)
        with pytest.raises(EtcdUnavailableError, match="unreachable for 0.5s at start"):
            await d.start()
        await d.close()

    run(body())
