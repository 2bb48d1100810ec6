"""Security, against real processes: API keys, per-key rate limits and secret hygiene on a real frontend; the TLS
configuration; etcd over TLS with a user and password, for registration and discovery. (Mutual TLS between the
services is exercised end to end by tests/cluster/test_fuzz.py, whose cluster runs over it.)"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli import main as cli_main
from services.discovery import EtcdSecurity, Registration, WorkerDirectory
from services.discovery.etcd import EtcdUnavailableError
from services.frontend.auth import AuthConfig, Guard
from services.frontend.errors import ApiError
from services.launcher import Cluster, Proc
from services.launcher import add_arguments as launcher_arguments
from services.rpc import pb
from services.runtime.api_keys import load_api_keys
from services.runtime.tls import GrpcTls, TlsConfigError
from tests.support.certs import make_ca_and_leaf
from tests.support.cluster import local_cluster, start_process
from tests.support.etcd import EtcdServer, etcd_binary, etcd_server  # noqa: F401

MODEL = "SmolLM2-135M-Instruct"
KEY_ALL = "sk-all-2f1c9e"
KEY_OTHER_MODEL = "sk-other-77ad01"
KEY_LIMITED = "sk-limited-5b90aa"
KEY_D = "sk-team-d-c4e812"
KEY_E = "sk-team-e-0b7d33"  # every model
KEY_F = "sk-team-f-9e41aa"  # other models only
SECRET_PROMPT = "my-private-prompt-do-not-log"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 4}


# ---- certificates -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_ca_and_leaf(tmp_path_factory.mktemp("certs"))


# ---- API keys on a real frontend --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded_frontend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A frontend process with six keys from a key file and a rate of 0.05 requests/s (burst 4) per key."""
    log_dir = tmp_path_factory.mktemp("frontend")
    keys = log_dir / "api-keys"
    keys.write_text(
        f"# the Kubernetes Secret's file\n{KEY_ALL} name=team-a\n"
        f"{KEY_OTHER_MODEL} name=team-b models=some-other-model\n{KEY_LIMITED} name=team-c\n{KEY_D} name=team-d\n"
        f"{KEY_E} name=team-e\n{KEY_F} name=team-f models=some-other-model\n"
    )
    flags = [
        "--api-key-file",
        str(keys),
        "--rate-limit-rps",
        "0.05",
        "--rate-limit-burst",
        "4",
        "--host",
        "127.0.0.1",
    ]

    def start(etcd_url: str) -> list:
        return [start_process("services.frontend.server", "frontend-sec", etcd_url, str(log_dir), *flags)]

    with local_cluster(str(log_dir), start, {"frontend": 1}) as c:
        yield f"http://{c.endpoints['frontend-sec']}", log_dir / "frontend-sec.log"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_v1_needs_a_known_bearer_key_and_answers_401_in_openai_shape(
    guarded_frontend: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = guarded_frontend
    with httpx.Client(base_url=url, timeout=30) as http:
        missing = http.get("/v1/models")
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        error = missing.json()["error"]
        assert error["type"] == "invalid_request_error" and "Authorization: Bearer" in error["message"]
        wrong = http.post("/v1/chat/completions", json=CHAT, headers=_auth("sk-nope"))
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        basic = http.get("/v1/models", headers={"Authorization": f"Basic {KEY_ALL}"})
        assert basic.status_code == 401
        # auth comes before the body is even parsed: garbage without a key is still a 401
        assert http.post("/v1/completions", content=b"{not json").status_code == 401
        ok = http.get("/v1/models", headers=_auth(KEY_ALL))
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
        # the planner's decision and the request timelines (workers, route reasons, client ids) too
        for path in ("/v1/plan", "/v1/requests/some-id/timeline"):
            assert http.get(path).status_code == 401, path
        known = http.get("/v1/requests/some-id/timeline", headers=_auth(KEY_OTHER_MODEL))
        assert known.status_code == 404 and known.json()["error"]["code"] == "request_not_found"
        # probes and scrapers need no key (this frontend has no decode worker: readiness says 503, not 401)
        assert http.get("/livez").status_code == 200
        assert http.get("/health").status_code == 503
        assert http.get("/metrics").status_code == 200
    # `rackserve timeline --url` sends the key it is given, and without one is told 401
    timeline = ["timeline", "--url", url, "--id", "some-id", "--out", os.devnull]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert cli_main(timeline) == 2 and "HTTP 401" in capsys.readouterr().err
    assert cli_main([*timeline, "--api-key", KEY_OTHER_MODEL]) == 2
    assert "HTTP 404" in capsys.readouterr().err
    monkeypatch.setenv("OPENAI_API_KEY", KEY_OTHER_MODEL)  # the default, as OpenAI clients read it
    assert cli_main(timeline) == 2 and "HTTP 404" in capsys.readouterr().err


def test_a_key_scoped_to_other_models_gets_403(guarded_frontend: tuple[str, Path]) -> None:
    url, _ = guarded_frontend
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=_auth(KEY_OTHER_MODEL), timeout=30)
    assert r.status_code == 403
    assert r.json()["error"] == {
        "message": f"The API key 'team-b' may not use the model '{MODEL}'",
        "type": "permission_error",
        "param": "model",
        "code": "model_not_allowed",
    }
    # the same request with a key for every model passes auth (and meets a cluster without routers: 503)
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=_auth(KEY_ALL), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_routers"
    # its tokenizer is not the key's either, named or not, and /v1/models lists only what the key may use (both until
    # 2026-12-07 answered any key)
    for path, body in (
        ("/tokenize", {"model": MODEL, "prompt": "hi"}),
        ("/detokenize", {"tokens": [1]}),
    ):
        r = httpx.post(f"{url}{path}", json=body, headers=_auth(KEY_F), timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed", path
        assert httpx.post(f"{url}{path}", json=body, headers=_auth(KEY_E), timeout=30).status_code == 200
    listed = httpx.get(f"{url}/v1/models", headers=_auth(KEY_F), timeout=30)
    assert listed.status_code == 200 and listed.json()["data"] == []
    listed = httpx.get(f"{url}/v1/models", headers=_auth(KEY_E), timeout=30)
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]


def test_a_key_past_its_rate_gets_429_with_retry_after(guarded_frontend: tuple[str, Path]) -> None:
    url, _ = guarded_frontend
    with httpx.Client(base_url=url, timeout=30) as http:
        statuses = [http.get("/v1/models", headers=_auth(KEY_LIMITED)).status_code for _ in range(4)]
        assert statuses == [200] * 4  # the burst
        limited = http.get("/v1/models", headers=_auth(KEY_LIMITED))
        assert limited.status_code == 429
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(limited.headers["retry-after"]) <= 20  # one request per 20 s
        # reading a request's timeline spends none of it (a load generator reads one after every request)
        timeline = http.get("/v1/requests/some-id/timeline", headers=_auth(KEY_LIMITED))
        assert timeline.status_code == 404 and timeline.json()["error"]["code"] == "request_not_found"
        # another key has its own budget
        assert http.get("/v1/models", headers=_auth(KEY_ALL)).status_code == 200


def test_only_the_key_that_sent_a_request_reads_its_timeline(guarded_frontend: tuple[str, Path]) -> None:
    url, log = guarded_frontend
    with httpx.Client(base_url=url, timeout=30) as http:
        # two keys send the same x-request-id; this frontend has no router, so each request fails (503) and
        # leaves a timeline
        for key in (KEY_ALL, KEY_D):
            sent = http.post(
                "/v1/chat/completions", json=CHAT, headers={**_auth(key), "x-request-id": "job-7"}
            )
            assert sent.status_code == 503
        mine = http.get("/v1/requests/job-7/timeline", headers=_auth(KEY_ALL))
        theirs = http.get("/v1/requests/job-7/timeline", headers=_auth(KEY_D))
        assert mine.status_code == theirs.status_code == 200
        a, d = mine.json(), theirs.json()
        assert a["request_id"] != d["request_id"] and a["status"] == d["status"] == 503
        assert (a["api_key_name"], d["api_key_name"]) == ("team-a", "team-d")  # names, never the keys
        # by our id, another key (even one allowed every model) is told what an unknown id is told
        for key, rid in (
            (KEY_D, a["request_id"]),
            (KEY_ALL, d["request_id"]),
            (KEY_LIMITED, a["request_id"]),
        ):
            other = http.get(f"/v1/requests/{rid}/timeline", headers=_auth(key))
            assert other.status_code == 404 and other.json()["error"]["code"] == "request_not_found"
        assert http.get(f"/v1/requests/{a['request_id']}/timeline", headers=_auth(KEY_ALL)).json() == a
    # the request log says which key sent each request
    logged = log.read_text(errors="replace")
    assert f'"request_id":"{a["request_id"]}"' in logged and '"api_key_name":"team-d"' in logged


def test_keys_and_prompts_never_reach_logs_or_metrics(guarded_frontend: tuple[str, Path]) -> None:
    url, log = guarded_frontend
    httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=_auth(KEY_ALL), timeout=30)
    httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=_auth(KEY_ALL + "x"), timeout=30)
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    logged = log.read_text(errors="replace")
    for secret in (KEY_ALL, KEY_OTHER_MODEL, KEY_LIMITED, SECRET_PROMPT):
        assert secret not in logged and secret not in metrics
    assert "request_finished" in logged  # the request log line exists; it just carries no prompt


def test_keys_compare_in_constant_time_against_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = load_api_keys("sk-one-1,sk-two-2,sk-three-3")
    guard = Guard(AuthConfig(keys))
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        assert len(a) == len(b) == 32  # digests, so the comparison never depends on the key's length
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for presented in ("sk-one-1", "sk-three-3", "sk-missing"):
        calls.clear()
        try:
            guard.authenticate(f"Bearer {presented}")
        except ApiError as e:
            assert e.status == 401
        assert len(calls) == 3, "every key is compared, whichever matches"
    assert keys[0].digest == hashlib.sha256(b"sk-one-1").digest()
    assert "sk-" not in repr(keys)  # the secret itself is not kept, so it cannot be printed


def test_key_file_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "keys"
    bad.write_text("sk-ok-ok-ok\nsk-bad-bad colour=blue\n")
    with pytest.raises(ValueError, match="line 2"):
        load_api_keys(key_file=str(bad))
    with pytest.raises(ValueError, match="no such file|No such file"):
        load_api_keys(key_file=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # a secret on the wrong word: the error names the line, never the word
        ("name=team-a sk-LIVESECRET123\n", "line 1: word 2 is not name=NAME"),
        ("sk-first-key name=team-a\nsk-second-key name=team-a\n", "the same name is given twice: team-a"),
        ("sk-same-secret name=a\nsk-same-secret name=b\n", "the same key is given twice: (not shown)"),
        ("sk-1\n", "shorter than 8 characters"),
    ],
    ids=["secret-as-second-word", "duplicate-name", "duplicate-secret", "too-short"],
)
def test_key_file_mistakes_are_refused_without_printing_a_secret(
    tmp_path: Path, text: str, says: str
) -> None:
    """From the security audit (until 2026-12-07): the misplaced secret was printed in the error; two keys of
    one name shared a rate limit and read each other's timelines; a secret listed twice silently took the
    last line's scope; a one-character key was taken."""
    keys = tmp_path / "keys"
    keys.write_text(text)
    with pytest.raises(ValueError) as e:
        load_api_keys(key_file=str(keys))
    assert says in str(e.value) and "LIVESECRET" not in str(e.value) and "same-secret" not in str(e.value)


def test_a_hash_inside_a_key_is_part_of_it_and_a_hash_after_a_space_a_comment(tmp_path: Path) -> None:
    """`sk-abc#Zq9x` authenticated as `sk-abc` (the rest taken for a comment) until 2026-12-07."""
    keys = tmp_path / "keys"
    keys.write_text("# a comment\nsk-abc#Zq9xYY name=hashy  # the rest of the line\n")
    (key,) = load_api_keys(key_file=str(keys))
    assert key.name == "hashy" and key.digest == hashlib.sha256(b"sk-abc#Zq9xYY").digest()


def test_rackserve_up_passes_the_key_in_the_environment_not_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    launcher_arguments(parser)
    args = parser.parse_args(["--api-key", "sk-up-123", "--etcd", "http://127.0.0.1:1"])
    spawned: list[tuple[str, list[str], dict[str, str]]] = []
    cluster = Cluster(args)

    def spawn(name: str, cmd: list[str], env: dict[str, str] | None = None, planned: bool = False) -> Proc:
        spawned.append((name, cmd, env or {}))
        return Proc(name, popen=None)  # type: ignore[arg-type]  # nothing started: the argv is what is checked

    monkeypatch.setattr(cluster, "spawn", spawn)
    cluster.start_etcd()
    cluster.start_services()
    frontend = [s for s in spawned if s[0] == "frontend"]
    assert frontend and frontend[0][2]["RACKSERVE_API_KEY"] == "sk-up-123"
    assert all("sk-up-123" not in " ".join(cmd) for _, cmd, _ in spawned)


# ---- mutual TLS between the services ----------------------------------------------------------------------------


def test_tls_flags_must_come_together_and_name_readable_pem_files(
    certs: dict[str, str], tmp_path: Path
) -> None:
    ns = argparse.Namespace(
        tls_cert_file=certs["cert"], tls_key_file="", tls_ca_file=certs["ca"], tls_server_name=""
    )
    with pytest.raises(TlsConfigError, match="--tls-key-file"):
        GrpcTls.from_args(ns)
    (tmp_path / "junk").write_text("not a certificate")
    ns.tls_key_file = str(tmp_path / "junk")
    with pytest.raises(TlsConfigError, match="not a PEM"):
        GrpcTls.from_args(ns)
    ns.tls_key_file = certs["key"]
    tls = GrpcTls.from_args(ns)
    assert tls is not None and "PRIVATE" not in repr(tls)
    assert GrpcTls.from_args(argparse.Namespace()) is None


# ---- etcd with TLS and a user --------------------------------------------------------------------------------------


class TlsEtcd(EtcdServer):
    """tests.support.etcd's server, listening with TLS and with etcd's auth turned on (user `rackserve`)."""

    def __init__(self, certs: dict[str, str], data_dir: str) -> None:
        super().__init__(data_dir=data_dir, name="rackserve-tls")
        self.certs = certs

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.client_port}"

    def command(self) -> list[str]:
        cmd = super().command()
        return cmd + ["--cert-file", self.certs["cert"], "--key-file", self.certs["key"]]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.etcdctl("endpoint", "health", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"TLS etcd not healthy\n{self.log_tail()}")

    def etcdctl(self, *args: str, check: bool = True, user: str = "") -> subprocess.CompletedProcess[str]:
        binary = os.path.join(os.path.dirname(etcd_binary()), "etcdctl")
        cmd = [binary, f"--endpoints={self.url}", f"--cacert={self.certs['ca']}", "--dial-timeout=2s"]
        cmd += [f"--user={user}"] if user else []
        return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=30, check=check)


def test_registration_and_discovery_work_against_etcd_with_tls_and_a_password(certs: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as d, TlsEtcd(certs, d) as etcd:
        etcd.etcdctl("user", "add", "root:root-pw")
        etcd.etcdctl("user", "add", "rackserve:s3cret-pw")
        etcd.etcdctl("role", "add", "rackserve")
        etcd.etcdctl("role", "grant-permission", "rackserve", "--prefix=true", "readwrite", "/rackserve/")
        etcd.etcdctl("user", "grant-role", "rackserve", "rackserve")
        etcd.etcdctl("auth", "enable", user="root:root-pw")
        password = Path(d) / "password"
        password.write_text("s3cret-pw\n")
        args = argparse.Namespace(
            etcd=etcd.url, etcd_ca_file=certs["ca"], etcd_cert_file="", etcd_key_file="",
            etcd_username="rackserve", etcd_password_file=str(password),
        )  # fmt: skip
        security = EtcdSecurity.from_args(args)
        assert security.tls and "s3cret" not in repr(security)
        info = pb.WorkerInfo(worker_id="d-tls", role="decode", endpoint="10.0.0.9:50051", epoch=1)

        async def scenario() -> list[str]:
            reg = await Registration.start(etcd.url, info, ttl_s=3.0, security=security)
            directory = WorkerDirectory(etcd.url, roles=("decode",), security=security)
            await directory.start()
            try:
                found = await directory.wait_for("decode", 1, 10.0)
                return [w.worker_id for w in found]
            finally:
                await directory.close()
                await reg.close()

        assert asyncio.run(asyncio.wait_for(scenario(), 30)) == ["d-tls"]
        # the same etcd refuses a client that brings no CA (it cannot verify etcd) or no password
        for wrong in (EtcdSecurity(tls=True), EtcdSecurity(tls=True, ca_cert=Path(certs["ca"]).read_bytes())):

            async def refused(sec: EtcdSecurity = wrong) -> None:
                directory = WorkerDirectory(etcd.url, roles=("decode",), connect_timeout_s=2.0, security=sec)
                try:
                    await directory.start()
                finally:
                    await directory.close()

            with pytest.raises(EtcdUnavailableError):
                asyncio.run(asyncio.wait_for(refused(), 30))
        # and the key really is there, under the user's own permissions
        out = etcd.etcdctl(
            "get", "--prefix", "/rackserve/", "--keys-only", user="rackserve:s3cret-pw", check=False
        )
        assert out.returncode == 0


def test_plain_etcd_urls_need_no_security_options() -> None:
    sec = EtcdSecurity.from_args(argparse.Namespace(etcd="http://127.0.0.1:2379"))
    assert sec == EtcdSecurity()
    with pytest.raises(ValueError, match="go together"):
        EtcdSecurity.from_args(argparse.Namespace(etcd="http://x", etcd_username="u", etcd_password_file=""))
