"""One rackserve gRPC service process, start to exit: server, health, registration, and the drain on SIGTERM.

    host = ServiceHost(args, role="decode", services=[SERVICE_NAME], gated_methods=[...])
    add_XServicer_to_server(servicer, host.server)
    await host.start()                   # bound and listening; health NOT_SERVING, requests turned away
    await host.serve(info)               # health SERVING, admitted, registered in etcd
    await host.wait_for_signal()         # SIGTERM or SIGINT
    await host.drain(abort_rest, settle) # see below; then return from serve() and the process exits 0

The drain: stop admitting new requests → health NOT_SERVING → delete the etcd key (gone for every router at
once) → let in-flight requests finish for up to `--drain-grace-s` → `abort_rest()` → `settle(what is left of the
grace)` (a prefill worker: until the KV it handed out has been pulled) → stop the server.

This room must never know what the service does; the servicer and its state belong to the service.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.discovery.etcd import EtcdSecurity
from services.discovery.registration import Registration
from services.rpc import pb
from services.runtime.args import advertised_host, topology, worker_id
from services.runtime.rpc import AdmissionGate, RpcInterceptor
from services.runtime.tls import GrpcTls, add_port
from services.telemetry import metrics, tracing
from services.telemetry.http import MetricsServer, start_metrics_server

log = logging.getLogger("rackserve.runtime.host")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# After abort_rest(), how long the aborted requests get to send their final status before the server stops.
_ABORT_SETTLE_S = 2.0
# grpc turns SO_REUSEPORT on by default: a second process given the same port would bind it too and take half
# its connections, silently; off, it fails to start instead
NO_SHARED_PORT = [("grpc.so_reuseport", 0)]
_SERVER_STOP_GRACE_S = 1.0


class ServiceHost:
    def __init__(
        self,
        args: argparse.Namespace,
        role: str,
        services: Collection[str],
        gated_methods: Collection[str],
    ) -> None:
        self.args = args
        self.role = role
        self.worker_id = worker_id(args, role)
        self.epoch_ms = int(time.time() * 1000)
        self.gate = AdmissionGate()
        self.health = health.aio.HealthServicer()
        self.services = ["", *services]  # "" is the whole server, as health checkers ask by default
        self.server = grpc.aio.server(
            interceptors=[RpcInterceptor(self.gate, gated_methods)], options=NO_SHARED_PORT
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.tls = GrpcTls.from_args(args)  # also what this service's own channels to its peers use
        self.etcd_security = EtcdSecurity.from_args(args)
        self.port = add_port(self.server, f"{args.host}:{args.port}", self.tls)
        # Health alone on a plaintext port: it says SERVING or not and nothing else, so probes need no certificate.
        self.health_server: grpc.aio.Server | None = None
        if getattr(args, "health_port", 0):
            self.health_server = grpc.aio.server(options=NO_SHARED_PORT)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            add_port(self.health_server, f"{args.host}:{args.health_port}", None)
        self.endpoint = f"{advertised_host(args)}:{self.port}"
        self.registration: Registration | None = None
        self._signalled = asyncio.Event()
        # from here, not from start(): a worker is PID 1 in its container, and Linux ignores a signal PID 1 has no
        # handler for, so a pod deleted while its model loads held its GPU until the kubelet's SIGKILL
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled.set)
        metrics.process_role = role
        tracing.configure(role, self.worker_id, args.otlp_endpoint, args.otlp_batch_delay_ms)
        self.metrics_server: MetricsServer | None = start_metrics_server(args.host, args.metrics_port)

    def worker_info(self, **fields: object) -> pb.WorkerInfo:
        """This process's WorkerInfo: identity, endpoint and topology, plus what the service adds."""
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            endpoint=self.endpoint,
            topology=topology(self.args),
            epoch=self.epoch_ms,
            # where others dial it (the advertised host, as for the gRPC endpoint: a wildcard is no address)
            metrics_endpoint=(
                f"{advertised_host(self.args)}:{self.metrics_server.endpoint.rsplit(':', 1)[1]}"
                if self.metrics_server is not None
                else ""
            ),
            **fields,  # type: ignore[arg-type]
        )

    async def start(self) -> None:
        for name in self.services:
            await self.health.set(name, _NOT_SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        log.info("%s %s listening on %s", self.role, self.worker_id, self.endpoint)

    async def serve(self, info: pb.WorkerInfo) -> None:
        """Open for requests, then tell the cluster: health SERVING, and the key in etcd."""
        self.gate.open()
        for name in self.services:
            await self.health.set(name, _SERVING)
        self.registration = await Registration.start(
            self.args.etcd, info, ttl_s=self.args.lease_ttl_s, security=self.etcd_security
        )
        log.info("%s %s serving on %s", self.role, self.worker_id, self.endpoint)

    async def wait_for_signal(self) -> None:
        """Until SIGTERM or SIGINT (at once when one came before: while the model loaded, say)."""
        await self._signalled.wait()

    async def drain(
        self,
        abort_rest: Callable[[], Awaitable[None]] | None = None,
        settle: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        """`settle(seconds_left)` runs once no request is in flight, with what is left of the grace: what the
        service must still hand over before it goes (a prefill worker's KV that no decode worker has pulled)."""
        grace_s = self.args.drain_grace_s
        t0 = time.monotonic()
        log.info(
            "%s %s draining: %d in flight, grace %.1fs",
            self.role,
            self.worker_id,
            self.gate.in_flight,
            grace_s,
        )
        self.gate.close()
        await self.health.enter_graceful_shutdown()
        if self.registration is not None:
            await self.registration.close()
        if not await self.gate.wait_idle(grace_s):
            log.warning("%s %s: %d requests still running after %.1fs; aborting them",
                        self.role, self.worker_id, self.gate.in_flight, grace_s)  # fmt: skip
            if abort_rest is not None:
                await abort_rest()
            await self.gate.wait_idle(_ABORT_SETTLE_S)
        if settle is not None:
            await settle(max(0.0, grace_s - (time.monotonic() - t0)))
        await self.server.stop(_SERVER_STOP_GRACE_S)
        if self.health_server is not None:
            await self.health_server.stop(0)
        log.info("%s %s stopped", self.role, self.worker_id)

    async def close(self) -> None:
        """Stop at once, whatever the state (idempotent; the normal path is drain())."""
        if self.registration is not None:
            await self.registration.close()
        await self.server.stop(0)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        tracing.shutdown()


def configure_logging() -> None:
    """One line per record on stderr (a no-op when the embedding program configured logging already)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def service_main(
    role: str,
    doc: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    serve: Callable[[argparse.Namespace], Coroutine[Any, Any, None]],
    argv: list[str] | None = None,
) -> int:
    """`python -m services.<role>.server ...`: the same flags and life as `rackserve <role> ...`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog=f"rackserve {role}", description=doc.strip().splitlines()[0])
    add_arguments(parser)
    asyncio.run(serve(parser.parse_args(argv)))
    return 0
