"""Test certificates made with the openssl CLI: one CA and one leaf usable as both TLS server and client.

certs = make_ca_and_leaf(tmp_path)            # {"cert": ..., "key": ..., "ca": ...} file paths
flags = tls_flags(certs)                      # the services' --tls-* flags for them
"""

from __future__ import annotations

import subprocess
from pathlib import Path

SERVER_NAME = "rackserve.internal"


def make_ca_and_leaf(directory: Path, name: str = SERVER_NAME) -> dict[str, str]:
    """A CA and one certificate for `name` (and 127.0.0.1) with serverAuth and clientAuth."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    d = str(directory)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=rackserve-test-ca",
            "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.crt")  # fmt: skip
    (directory / "leaf.ext").write_text(
        f"subjectAltName=DNS:{name},IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
    )
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{d}/tls.key", "-out", f"{d}/tls.csr")  # fmt: skip
    openssl("x509", "-req", "-in", f"{d}/tls.csr", "-CA", f"{d}/ca.crt", "-CAkey", f"{d}/ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{d}/leaf.ext", "-out", f"{d}/tls.crt")  # fmt: skip
    return {"cert": f"{d}/tls.crt", "key": f"{d}/tls.key", "ca": f"{d}/ca.crt"}


def tls_flags(certs: dict[str, str], server_name: str = SERVER_NAME) -> list[str]:
    return ["--tls-cert-file", certs["cert"], "--tls-key-file", certs["key"], "--tls-ca-file", certs["ca"],
            "--tls-server-name", server_name]  # fmt: skip
