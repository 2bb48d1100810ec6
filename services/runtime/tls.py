"""Transport security of the internal gRPC links: optional mutual TLS between every rackserve service.

Off by default (a laptop cluster needs no certificates). With `--tls-cert-file`, `--tls-key-file` and
`--tls-ca-file` set, every server listens with TLS and *requires* a client certificate signed by that CA, and
every channel a service opens presents the same certificate and trusts only that CA: one Secret per cluster
(on Kubernetes, cert-manager or any CA) gives every service both halves of the handshake.

Workers register endpoints by address (a pod IP), which no certificate names; `--tls-server-name` is the name
the certificates carry (a SAN such as `rackserve.internal`) and every channel checks it instead of the address.

    tls = GrpcTls.from_args(args)              # None when TLS is off
    port = add_port(server, "0.0.0.0:0", tls)  # every server binds through this
    channel = open_channel(endpoint, tls)      # every channel to a rackserve service opens through this

This room only turns files into credentials; it never logs key material.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

TLS_FLAGS = ("--tls-cert-file", "--tls-key-file", "--tls-ca-file")


class TlsConfigError(ValueError):
    """The TLS flags are incomplete or name unreadable files."""


@dataclass(frozen=True)
class GrpcTls:
    cert_chain: bytes
    private_key: bytes
    root_certs: bytes
    server_name: str = ""

    @classmethod
    def from_files(cls, cert_file: str, key_file: str, ca_file: str, server_name: str = "") -> GrpcTls:
        given = {"--tls-cert-file": cert_file, "--tls-key-file": key_file, "--tls-ca-file": ca_file}
        missing = [flag for flag, path in given.items() if not path]
        if missing:
            raise TlsConfigError(f"mutual TLS needs all of {list(TLS_FLAGS)}; missing {missing}")
        blobs = {}
        for flag, path in given.items():
            try:
                blobs[flag] = Path(path).read_bytes()
            except OSError as e:
                raise TlsConfigError(f"{flag} {path}: {e.strerror or e}") from e
            if b"-----BEGIN" not in blobs[flag]:
                raise TlsConfigError(f"{flag} {path}: not a PEM file")
        return cls(blobs["--tls-cert-file"], blobs["--tls-key-file"], blobs["--tls-ca-file"], server_name)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GrpcTls | None:
        """None when no TLS flag is set; the config when all are; TlsConfigError when only some are."""
        cert, key, ca = (getattr(args, f.lstrip("-").replace("-", "_"), "") for f in TLS_FLAGS)
        if not (cert or key or ca):
            return None
        return cls.from_files(cert, key, ca, getattr(args, "tls_server_name", ""))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.root_certs, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certs, private_key=self.private_key, certificate_chain=self.cert_chain
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def __repr__(self) -> str:  # never print key material, even by accident
        return f"GrpcTls(server_name={self.server_name!r}, mutual=True)"


def add_port(server: grpc.aio.Server, address: str, tls: GrpcTls | None) -> int:
    """Bind `server` to `address`, with mutual TLS when `tls` is set; the bound port. A port that cannot be bound
    (in use, a host not of this machine) is an OSError naming the address: grpc's RuntimeError would be a traceback
    from the service's command."""
    try:
        if tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as e:
        raise OSError(f"cannot bind {address} (in use, or not an address of this host)") from e


def open_channel(
    target: str, tls: GrpcTls | None, options: list[tuple[str, object]] | None = None
) -> grpc.aio.Channel:
    """A channel to another rackserve service: mutual TLS when `tls` is set, plaintext otherwise."""
    opts: list[tuple[str, object]] = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(target, options=opts)
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=opts + tls.channel_options())
