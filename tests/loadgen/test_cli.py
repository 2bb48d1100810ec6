"""`rackserve bench run`'s own requests before the load: the model it asks the endpoint for."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator

import pytest

from loadgen import cli

KEY = "bench-key-1234"


class _KeyedModels(http.server.BaseHTTPRequestHandler):
    """/v1/models as a frontend with keys answers it: 401 without the Bearer key."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            body, status = b'{"error": {"message": "missing or invalid API key"}}', 401
        else:
            body, status = json.dumps({"object": "list", "data": [{"id": "keyed-model"}]}).encode(), 200
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def keyed_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedModels)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_default_model_is_asked_for_with_the_runs_key(keyed_url: str) -> None:
    """`bench run` without --model asked /v1/models without the key: against `rackserve up --api-key` (the key in
    $RACKSERVE_API_KEY, as the README says) every run died on a 401 traceback before sending a request."""
    assert cli._default_model(keyed_url, KEY) == "keyed-model"
    with pytest.raises(ValueError, match="HTTP 401"):
        cli._default_model(keyed_url, None)


def test_an_endpoint_not_answering_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    # a port bound and not listening: a connection to it is refused
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        rc = cli.main(
            ["run", "--url", f"http://127.0.0.1:{port}", "--workload", "synthetic", "--num-requests", "1"]
        )
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"loadgen: error: http://127.0.0.1:{port}: ConnectError")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("n", ["0", "-1"])
def test_a_request_count_below_one_is_refused_by_name(n: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--num-requests 0` or -1 sent nothing and ended in "cannot convert float NaN to integer" (an empty report)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "--model", "m", "--workload", "synthetic", "--num-requests", n])
    assert exited.value.code == 2
    assert "argument --num-requests" in capsys.readouterr().err
