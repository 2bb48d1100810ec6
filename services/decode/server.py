"""The decode worker: streams a request's tokens with continuous batching over a paged KV cache.

Today it runs the aggregated path: with `DecodeRequest.kv` unset it prefills the prompt (and any tokens the
client already saw) itself, then decodes. Each engine output becomes one `DecodeChunk`; token indices count
from the start of the whole output, so a request resumed with `emitted_token_ids` continues where it stopped.
Pulling KV named in a `KvHandle` arrives with the transfer engine.

This room must never hold state past a request's stream, or talk to the router or to other workers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator

import grpc

from services.rpc import pb, pb_grpc
from services.runtime import wire
from services.runtime.args import add_engine_arguments, add_service_arguments
from services.runtime.async_engine import AsyncEngine
from services.runtime.errors import UnsupportedError, WorkerUnavailableError
from services.runtime.host import ServiceHost, service_main
from services.runtime.worker import EngineWorker, run_engine_worker

ROLE = "decode"
SERVICE_NAME = "rackserve.v1.DecodeWorker"
GATED_METHODS = (f"/{SERVICE_NAME}/Decode",)


class DecodeWorker(EngineWorker, pb_grpc.DecodeWorkerServicer):
    async def Decode(  # noqa: N802 - gRPC method name
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeChunk]:
        if request.HasField("kv"):
            raise UnsupportedError(
                "DecodeRequest.kv is not supported yet: KV pull arrives with the transfer engine; "
                "leave kv unset to prefill on this worker"
            )
        request_id = self.request_id(request.request_id, context)
        params = wire.sampling_params(request.params)
        index = len(request.emitted_token_ids)
        first = True
        async with self.engine.generate(
            request_id, request.prompt_token_ids, params, output_ids=request.emitted_token_ids
        ) as stream:
            async for out in stream:
                if out.finish_reason == "abort" and self.host.gate.draining:
                    raise WorkerUnavailableError(
                        f"worker {self.host.worker_id} drained before request {request_id!r} finished; "
                        "resume it elsewhere with the tokens emitted so far"
                    )
                chunk = pb.DecodeChunk(
                    tokens=wire.tokens(out, index),
                    finished=out.finished,
                    finish_reason=out.finish_reason or "",
                    stop_reason=wire.stop_reason(out),
                )
                if first:
                    chunk.prompt_tokens, chunk.cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
                    first = False
                index += len(out.new_token_ids)
                yield chunk


def _make(host: ServiceHost, engine: AsyncEngine) -> DecodeWorker:
    return DecodeWorker(host, engine)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser)
    add_engine_arguments(parser)


async def serve(args: argparse.Namespace) -> None:
    await run_engine_worker(
        args, ROLE, SERVICE_NAME, GATED_METHODS, _make, pb_grpc.add_DecodeWorkerServicer_to_server
    )


if __name__ == "__main__":
    sys.exit(service_main(ROLE, __doc__ or "", add_arguments, serve))
