"""The frontend service: the OpenAI-compatible HTTP edge and the request coordinator (docs/design.md).

    protocol.py      the API contract: pydantic request and response models
    errors.py        OpenAI-shaped errors, and how gRPC failures map onto HTTP statuses
    dependencies.py  request limits (body size) and body parsing, as FastAPI dependencies
    output.py        tokens to client text: incremental detokenization, stop strings, logprobs
    coordinator.py   per-request state and phases; drives Route → Decode and owns the emitted tokens
    metrics.py       the frontend's Prometheus metrics (names live only there)
    app.py           the FastAPI app factory and its endpoints
    server.py        flags and `serve`: `python -m services.frontend.server`

The frontend never loads model weights: it reads only the tokenizer from the model file.
"""
