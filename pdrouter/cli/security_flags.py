"""The flags and variables every component shares for TLS and the internal secret.

``--tls-ca/--tls-cert/--tls-key`` (or ``PDROUTER_TLS_CA/_CERT/_KEY``, which ``pdrouter up`` hands its
children) turn TLS on for every port of the process: a worker's gRPC port, lane and KV receiver
require client certificates from the CA (mutual TLS) and its calls out present its own; the router's
front doors serve the certificate to any client and its calls to the workers present it.

``PDROUTER_INTERNAL_TOKEN`` (or ``PDROUTER_INTERNAL_TOKEN_FILE``) is the secret the router and the
workers share; workers refuse internal calls without it. ``PDROUTER_REDIS_PASSWORD`` (or ``_FILE``) is Redis's
password, for ``--redis`` URLs that carry none.
"""

from __future__ import annotations

import argparse
import os

from pdrouter.core.errors import ConfigError
from pdrouter.core.secrets_env import secret_from_env
from pdrouter.core.tls import TLS_ENV, TlsFiles
from pdrouter.state.client import PASSWORD_ENV, url_with_password
from pdrouter.wire.security import INTERNAL_TOKEN_ENV, check_token


def add_tls_flags(p: argparse.ArgumentParser, *, server_help: str) -> None:
    """``--tls-ca``, ``--tls-cert``, ``--tls-key`` (defaults from ``PDROUTER_TLS_*``)."""
    ca, cert, key = TLS_ENV
    p.add_argument("--tls-ca", default=os.environ.get(ca) or None, metavar="PEM",
                   help=f"CA that signs the cluster's certificates (env {ca}); with it, {server_help}")
    p.add_argument("--tls-cert", default=os.environ.get(cert) or None, metavar="PEM",
                   help=f"this process's certificate chain (env {cert})")
    p.add_argument("--tls-key", default=os.environ.get(key) or None, metavar="PEM",
                   help=f"the certificate's private key (env {key})")


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files the flags name (None: plaintext); ConfigError for a missing file or half a pair."""
    tls = TlsFiles.from_flags(args.tls_ca, args.tls_cert, args.tls_key)
    if tls is not None and not (tls.cert and tls.key):
        raise ConfigError("TLS needs --tls-cert and --tls-key (and --tls-ca to verify peers)")
    return tls


def internal_token_from_env() -> str | None:
    """``PDROUTER_INTERNAL_TOKEN`` (or the file ``PDROUTER_INTERNAL_TOKEN_FILE`` names), checked; None if unset."""
    token = secret_from_env(INTERNAL_TOKEN_ENV)
    return None if token is None else check_token(token)


def redis_url(url: str | None) -> str | None:
    """``--redis``'s URL with ``PDROUTER_REDIS_PASSWORD`` (or the file ``PDROUTER_REDIS_PASSWORD_FILE``
    names) as its password when it carries none."""
    return None if not url else url_with_password(url, secret_from_env(PASSWORD_ENV))
