"""TLS material from one set of flags (``--tls-ca``, ``--tls-cert``, ``--tls-key``), for every port.

:class:`TlsFiles` names PEM files; it builds the ``ssl.SSLContext`` objects the HTTP door, the lane
and the KV transfer use, and the PEM bytes that ``pdrouter.wire.grpc_util`` turns into gRPC
credentials for the gRPC door, the worker ports and the decode → prefill channels. The rules, the same on every port:

- a server presents ``cert``/``key``; with ``ca`` set it also **requires** a client certificate
  signed by that CA (mutual TLS). A server without ``ca`` accepts any client (the public doors);
- a client verifies the server against ``ca`` (the system trust store without it) and presents
  ``cert``/``key`` when it has them;
- TLS 1.2 is the floor; host names are checked against the certificate's subject alternative
  names (``server_hostname`` overrides the name dialled, e.g. for an address given as an IP).

Files are read when a context is built, so a restart picks up rotated certificates.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from pdrouter.core.errors import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths: ``ca`` (trust anchor for peers), ``cert`` + ``key`` (this process's identity)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
        for flag, path in (("--tls-ca", self.ca), ("--tls-cert", self.cert), ("--tls-key", self.key)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")

    @classmethod
    def from_flags(cls, ca: str | None, cert: str | None, key: str | None) -> TlsFiles | None:
        """The files, or ``None`` when no flag was given (plaintext)."""
        if not (ca or cert or key):
            return None
        return cls(ca or None, cert or None, key or None)

    @property
    def mutual(self) -> bool:
        """Whether servers built from these files require client certificates."""
        return bool(self.ca)

    def _read(self, path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    # ssl (asyncio and blocking sockets) ------------------------------------------------------

    def server_context(self, *, require_client_cert: bool | None = None) -> ssl.SSLContext:
        """A server context; client certificates are required when ``ca`` is set (or as told)."""
        if not self.cert or not self.key:
            raise ConfigError("a TLS server needs --tls-cert and --tls-key")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        mutual = self.mutual if require_client_cert is None else require_client_cert
        if mutual:
            if not self.ca:
                raise ConfigError("requiring client certificates needs --tls-ca")
            ctx.load_verify_locations(cafile=self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A client context: verifies the server, presents this process's certificate if any."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca:
            ctx.load_verify_locations(cafile=self.ca)
        else:
            ctx.load_default_certs()
        if self.cert and self.key:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def pem(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """The files' bytes ``(ca, cert, key)``, for gRPC credentials (``pdrouter.wire.grpc_util``)."""
        return self._read(self.ca), self._read(self.cert), self._read(self.key)


TLS_ENV = ("PDROUTER_TLS_CA", "PDROUTER_TLS_CERT", "PDROUTER_TLS_KEY")


def tls_from_env(environ: dict[str, str] | None = None) -> TlsFiles | None:
    """The files named by ``PDROUTER_TLS_CA``/``_CERT``/``_KEY`` (how ``pdrouter up`` hands them on)."""
    env = os.environ if environ is None else environ
    ca, cert, key = (env.get(name) or None for name in TLS_ENV)
    return TlsFiles.from_flags(ca, cert, key)
