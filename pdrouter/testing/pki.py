"""A test PKI: a CA made by ``trustme`` and certificates it issues, written as the PEM files the
``--tls-*`` flags name. For tests and benchmarks (``trustme`` is a development dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdrouter.core.tls import TlsFiles

LOCAL_HOSTS = ("127.0.0.1", "localhost")
"""The names a certificate for a process on this machine carries."""


class TestCa:
    """One CA, its certificate at ``folder/<name>-ca.pem``; :meth:`issue` writes certificates it signs."""

    __test__ = False  # not a pytest test class

    def __init__(self, folder: Path, name: str = "test") -> None:
        import trustme

        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.name = folder, name
        self._ca: Any = trustme.CA()
        self.ca_path = folder / f"{name}-ca.pem"
        self._ca.cert_pem.write_to_path(str(self.ca_path))

    def issue(self, name: str, *hosts: str, trust: TestCa | None = None) -> TlsFiles:
        """A certificate (chain and key) for ``hosts`` (default: this machine's names), with the CA
        it trusts: ``trust``'s (default: this one's)."""
        leaf = self._ca.issue_cert(*(hosts or LOCAL_HOSTS))
        cert, key = self.folder / f"{self.name}-{name}.crt", self.folder / f"{self.name}-{name}.key"
        cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(key))
        return TlsFiles(str((trust or self).ca_path), str(cert), str(key))


def tls_flags(tls: TlsFiles) -> tuple[str, ...]:
    """The ``--tls-ca/--tls-cert/--tls-key`` arguments naming ``tls``'s files."""
    return tuple(arg for flag, path in (("--tls-ca", tls.ca), ("--tls-cert", tls.cert), ("--tls-key", tls.key))
                 if path for arg in (flag, path))
