"""The frontend service: the OpenAI-compatible HTTP edge and the request coordinator (docs/design.md).

    protocol.py      the API contract: pydantic request and response models
    errors.py        OpenAI-shaped errors, and how gRPC failures map onto HTTP statuses
    dependencies.py  request limits (body size) and body parsing, as FastAPI dependencies
    output.py        tokens to client text: incremental detokenization, stop strings, logprobs
    request_state.py a request's state: phases and their transitions, emitted tokens, migration records
    coordinator.py   drives each request through Route → Prefill → Decode, and migrates it when a worker fails
    worker_lost.py   which failed worker calls are a lost worker (migrate) and which the request's own error
    kv_hold.py       the prefill copy of a prompt's KV: hold, ExtendHold while streaming, re-transfer, Release
    timeline.py      what a finished request leaves: its timeline, request-log line, spans and phase metrics
    auth.py          API keys and the per-key rate limit
    app.py           the FastAPI app factory and its endpoints
    server.py        flags and `serve`: `python -m services.frontend.server`

The frontend never loads model weights: it reads only the tokenizer from the model file.
"""
