"""The frontend process: flags, discovery, the HTTP server, and its own registration in etcd.

    python -m services.frontend.server --etcd http://127.0.0.1:2379 --port 8000

Every flag also reads `RACKSERVE_<FLAG>` (e.g. `RACKSERVE_REQUEST_TIMEOUT_S`). The frontend follows routers
and workers in etcd and registers itself with role `frontend` once it is listening, so a launcher can wait for
it there. It reads only the tokenizer from the model file, never the weights.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.discovery import EtcdSecurity, Registration, WorkerDirectory
from services.engine.tokenizer import Tokenizer
from services.frontend.app import DEFAULT_MAX_MODEL_LEN, FrontendConfig, create_app
from services.frontend.auth import AuthConfig
from services.frontend.coordinator import DEFAULT_MIGRATION_LIMIT, DEFAULT_STALL_TIMEOUT_S, Coordinator
from services.frontend.errors import unavailable
from services.frontend.timeline import DEFAULT_TIMELINE_HISTORY, RequestObserver
from services.rpc import pb
from services.runtime.api_keys import load_api_keys
from services.runtime.args import (
    add_advertise_host,
    add_flag,
    add_security_arguments,
    add_telemetry_arguments,
    advertised_host,
    comma_list,
    port_number,
    switch,
)
from services.runtime.channels import ChannelPool
from services.runtime.tls import GrpcTls
from services.telemetry import tracing

log = logging.getLogger("rackserve.frontend")

ROLE = "frontend"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the served name of the default model (the wheel's GGUF)
STARTUP_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("frontend")
    add_flag(g, "--etcd", "http://127.0.0.1:2379", "etcd endpoint for discovery")
    add_flag(g, "--host", "127.0.0.1", "address to listen on")
    add_advertise_host(g)
    add_flag(g, "--port", 8000, "HTTP port (0: an ephemeral port; the bound one is registered)", port_number)
    add_flag(g, "--model", "", "the model's .gguf file or Hugging Face directory; only its tokenizer is read "
             "(default: SmolLM2-135M-Instruct)")  # fmt: skip
    add_flag(
        g, "--served-model-name", "", "model id clients send and /v1/models lists (default: from --model)"
    )
    add_flag(g, "--max-model-len", 0, f"context length in tokens (0: the decode workers', else "
             f"{DEFAULT_MAX_MODEL_LEN})", int)  # fmt: skip
    add_flag(
        g, "--request-timeout-s", 600.0, "deadline of one request, from arrival to its last token", float
    )
    add_flag(g, "--allowed-origins", "", "origins browsers may call the API from, `,`-separated (CORS; `*`: any; "
             "default: none, no CORS headers)", comma_list)  # fmt: skip
    add_flag(g, "--max-body-bytes", 4 << 20, "largest request body accepted (413 above)", int)
    add_flag(g, "--body-timeout-s", 30.0, "a request body must arrive whole within this (408 past it)", float)
    add_flag(g, "--max-connections", 2048, "open HTTP connections and requests at once before new ones get 503 "
             "(uvicorn's limit_concurrency; streams included, so above --max-concurrent-requests)", int)  # fmt: skip
    add_flag(g, "--max-concurrent-requests", 256, "requests in flight before new ones get 429 with "
             "Retry-After (0: no limit)", int)  # fmt: skip
    add_flag(g, "--max-concurrent-per-key", 0, "one API key's requests in flight before its new ones get 429 "
             "(0: no limit of its own; set it below --max-concurrent-requests to keep one key from holding "
             "them all)", int)  # fmt: skip
    add_flag(g, "--admission-kv-factor", 2.0, "KV tokens in flight (prompt + up to 256 output tokens each) allowed "
             "as a multiple of what the decode workers hold, before new requests get 429 with Retry-After "
             "(1: one full pool; above it the rest waits in the workers' queues; 0: no KV budget)", float)  # fmt: skip
    add_flag(g, "--migration-limit", DEFAULT_MIGRATION_LIMIT, "times one request may move to another worker "
             "after a failure before it fails with migration_limit_exceeded", int)  # fmt: skip
    add_flag(g, "--worker-stall-timeout-s", DEFAULT_STALL_TIMEOUT_S, "a worker that sends nothing on a live "
             "call for this long is treated as hung: reported, and the request migrates", float)  # fmt: skip
    add_flag(g, "--worker-id", "", "id in discovery (default: frontend-HOSTNAME-PID)")
    add_flag(g, "--lease-ttl-s", 3.0, "etcd lease TTL of the frontend's registration", float)
    add_flag(g, "--log-level", "info", "log level", choices=("debug", "info", "warning", "error"))
    add_flag(g, "--request-log", "", "append one JSON line per finished request to this file (default: the "
             "rackserve.requests logger on stderr)")  # fmt: skip
    switch(g, "--log-prompts", "debug: put each request's prompt token ids in its request-log line")
    add_flag(g, "--timeline-history", DEFAULT_TIMELINE_HISTORY,
             "finished requests whose timeline GET /v1/requests/{id}/timeline still serves", int)  # fmt: skip
    add_telemetry_arguments(parser, metrics_port=False)
    a = parser.add_argument_group("API keys and limits")
    add_flag(a, "--api-key", "", "require this Bearer key on /v1/* (comma-separated for several; prefer the env "
             "variable or --api-key-file, which stay out of `ps`)")  # fmt: skip
    add_flag(
        a, "--api-key-file", "", "file of keys, one a line: KEY [name=NAME] [models=a,b] (a mounted Secret)"
    )
    add_flag(a, "--rate-limit-rps", 0.0, "requests per second per API key, 429 above (0: no limit)", float)
    add_flag(
        a, "--rate-limit-burst", 0, "requests a key may burst above its rate (0: one second's worth)", int
    )
    add_security_arguments(parser)


def load_tokenizer(model: str) -> tuple[Tokenizer, str]:
    """The tokenizer of `model` (a GGUF file or an HF directory; "" = the default model) and its served name."""
    if not model:
        from services.engine.model_files import smollm2_gguf_path

        return Tokenizer.from_gguf(smollm2_gguf_path()), DEFAULT_MODEL_NAME
    path = os.path.abspath(model)
    name = os.path.basename(path.rstrip(os.sep))
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path), name
    return Tokenizer.from_gguf(path), os.path.splitext(name)[0]


async def serve(args: argparse.Namespace) -> None:
    tokenizer, default_name = load_tokenizer(args.model)
    config = FrontendConfig(
        served_model_name=args.served_model_name or default_name,
        max_model_len=args.max_model_len,
        request_timeout_s=args.request_timeout_s,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout_s,
        auth=AuthConfig(
            load_api_keys(args.api_key, args.api_key_file), args.rate_limit_rps, args.rate_limit_burst
        ),
        max_concurrent_requests=args.max_concurrent_requests,
        max_concurrent_per_key=args.max_concurrent_per_key,
        admission_kv_factor=args.admission_kv_factor,
        allowed_origins=args.allowed_origins,
    )
    if not config.auth.keys:
        log.warning("no API key configured: the API is open to anyone who can reach port %d", args.port)
    worker_id = args.worker_id or f"{ROLE}-{socket.gethostname()}-{os.getpid()}"
    tracing.configure(ROLE, worker_id, args.otlp_endpoint, args.otlp_batch_delay_ms)
    etcd_security = EtcdSecurity.from_args(args)
    directory = WorkerDirectory(
        args.etcd, roles=("router", "decode", "prefill", "planner", "frontend"), security=etcd_security
    )
    await directory.start()
    coordinator = Coordinator(
        directory,
        ChannelPool(GrpcTls.from_args(args)),
        migration_limit=args.migration_limit,
        stall_timeout_s=args.worker_stall_timeout_s,
    )
    observer = RequestObserver(args.timeline_history, args.request_log, args.log_prompts)
    app = create_app(config, tokenizer, directory, coordinator, observer)
    # a drain waits for the requests in flight, each at most until its deadline (and a stalled stream's grace),
    # then closes what is left: a client that stops reading a large answer cannot hold the process
    graceful_s = math.ceil(config.request_timeout_s + config.stalled_client_grace_s)
    server = _DrainingServer(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
            timeout_graceful_shutdown=graceful_s,
            limit_concurrency=args.max_connections or None, http=HttpProtocol,
            # the connection's own peer, not X-Forwarded-For's: nothing here reads a client's address but
            # connection_aborter, which must find the connection (a local proxy would otherwise hide it)
            proxy_headers=False,
        )
    )  # fmt: skip
    app.state.abort_connection = connection_aborter(server)
    registration: Registration | None = None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = loop.create_task(server.serve(), name="uvicorn")
    try:
        await _until_started(server, serving)
        port = server.servers[0].sockets[0].getsockname()[1]
        host = advertised_host(args)
        log.info(
            "frontend serving %r on http://%s:%d (registered as %s)",
            config.served_model_name,
            args.host,
            port,
            host,
        )
        info = pb.WorkerInfo(
            worker_id=worker_id,
            role=ROLE,
            endpoint=f"{host}:{port}",
            model_name=config.served_model_name,
            max_model_len=config.max_model_len,
            epoch=int(time.time() * 1000),
        )
        registration = await Registration.start(
            args.etcd, info, ttl_s=args.lease_ttl_s, security=etcd_security
        )
        stopping = loop.create_task(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if stop.is_set():  # drain: leave discovery first, then let uvicorn finish the requests in flight
            log.info("frontend draining: leaving discovery, finishing requests in flight")
            await registration.close()
            registration = None
    finally:
        if registration is not None:
            await registration.close()
        if not serving.done():
            server.should_exit = True
            await serving
        await directory.close()
        tracing.shutdown()


def connection_aborter(server: uvicorn.Server) -> Callable[[Any], bool]:
    """abort(client address): reset the server's connection with that client at once, not waiting to flush
    what it has not read (a stream cut past its deadline, app.EventStreamResponse); False if none is open."""

    def abort(client: Any) -> bool:
        for conn in list(server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if (
                client is not None
                and getattr(conn, "client", None) == tuple(client)
                and transport is not None
            ):
                transport.abort()
                return True
        return False

    return abort


class HttpProtocol(H11Protocol):
    """uvicorn's HTTP protocol, whose refusal past --max-connections (its limit_concurrency) is a 503 in OpenAI's
    error shape with Retry-After, as every other refusal here, not uvicorn's text/plain "Service Unavailable".

    uvicorn makes its test when a request's headers are complete, and runs `self.app` when under the limit: its
    own test is turned off here and the same one made where `app` is read, so the limit counts as before."""

    _limit: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limit, self.limit_concurrency = self.limit_concurrency, None

    @property  # type: ignore[override]
    def app(self) -> Any:
        limit = self._limit
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            return self._refuse
        return self._app

    @app.setter
    def app(self, app: Any) -> None:
        self._app = app

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        log.warning("refused a request: %d connections and requests open (--max-connections)", self._limit)
        error = unavailable(
            f"the frontend has its limit of {self._limit} connections and requests open", code="overloaded"
        )
        response = error.response()
        # the connection goes, so that its slot does
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class _DrainingServer(uvicorn.Server):
    """uvicorn without its own signal handling: `serve` drains on SIGTERM/SIGINT itself, so the process leaves
    discovery and exits 0 (uvicorn's handler re-raises the signal after its shutdown, killing the process
    before the registration is deleted)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn logs a bind's OSError and exits the process from inside the event loop (SystemExit 3, printed
        # as a task's traceback); the OSError itself is this service's error: `rackserve frontend` says it in
        # one line and `up` shows it as the frontend's last line
        try:
            await super().startup(sockets)
        except SystemExit as e:
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise


async def _until_started(server: uvicorn.Server, serving: asyncio.Task[None]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if serving.done():
            serving.result()  # raises what stopped it
            raise RuntimeError("the HTTP server exited before it started (is the port in use?)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start within {STARTUP_TIMEOUT_S:g}s")
        await asyncio.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rackserve frontend", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
