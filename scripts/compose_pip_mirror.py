#!/usr/bin/env python3
"""The host's pip configuration, made usable inside ``docker build`` (for scripts/compose_check.sh).

A host's pip may be configured with local folders (``find-links = /opt/wheels``, an
``extra-index-url = file:///opt/pypi/simple``) that a build container cannot see. This reads the
host's effective pip settings (the config files pip reads, then ``PIP_*`` variables, ``[global]``
then ``[install]``), serves every local folder among them over HTTP on 127.0.0.1 under its own path (build with
``--network host``), and writes the matching build arguments of deploy/Dockerfile to a file, one
``NAME=VALUE`` a line: ``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL``, ``PIP_FIND_LINKS``,
``PIP_TRUSTED_HOST`` (remote URLs pass unchanged), and ``CA_BUNDLE=PATH``: the CA bundle the host's
pip trusts, for deploy/build-extra/. Then it serves until SIGTERM / SIGINT. Standard library only.

    python3 scripts/compose_pip_mirror.py --out build-args.txt [--port 47613]

The build arguments are part of Docker's cache key for every later RUN step: serve on a fixed
port (``--port``) for builds that reuse their layers.
"""

from __future__ import annotations

import argparse
import configparser
import functools
import os
import posixpath
import signal
import sys
import threading
import urllib.parse
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

KEYS = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert")
"""The pip settings that decide where packages come from and whom pip trusts."""
DEFAULT_CA = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")


def config_files() -> list[Path]:
    """pip's configuration files in the order pip reads them (later ones win)."""
    home = Path.home()
    xdg = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":")
    files = [*(Path(d) / "pip" / "pip.conf" for d in reversed(xdg)), Path("/etc/pip.conf"),
             home / ".pip" / "pip.conf", Path(os.environ.get("XDG_CONFIG_HOME", home / ".config")) / "pip" / "pip.conf"]
    if os.environ.get("VIRTUAL_ENV"):
        files.append(Path(os.environ["VIRTUAL_ENV"]) / "pip.conf")
    if os.environ.get("PIP_CONFIG_FILE") and os.environ["PIP_CONFIG_FILE"] != os.devnull:
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    return files


def host_settings() -> dict[str, str]:
    """The effective value of each of :data:`KEYS` (absent when unset)."""
    settings: dict[str, str] = {}
    if os.environ.get("PIP_CONFIG_FILE") != os.devnull:
        for path in config_files():
            parser = configparser.RawConfigParser()
            try:
                parser.read(path)
            except (OSError, configparser.Error):
                continue
            for section in ("global", "install"):
                if parser.has_section(section):
                    for key in KEYS:
                        if parser.has_option(section, key):
                            settings[key] = parser.get(section, key)
    for key in KEYS:
        value = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if value is not None:
            settings[key] = value
    return settings


class Mirror:
    """Local folders served by one HTTP server on 127.0.0.1 under their own paths.

    An index folder's parent is served too: simple indexes commonly link their files as siblings
    (``../../files/x.whl``). Nothing outside the served folders is.
    """

    def __init__(self) -> None:
        self.roots: list[Path] = []
        self.server: ThreadingHTTPServer | None = None

    def url(self, folder: Path, index: bool) -> str:
        folder = folder.resolve()
        root = folder.parent if index else folder
        if root not in self.roots:
            self.roots.append(root)
        return "http://127.0.0.1:{port}" + urllib.parse.quote(str(folder)) + "/"

    def start(self, port: int = 0) -> int:
        """Serve on ``port`` (a free one if it is 0 or taken); the port served on."""
        handler = functools.partial(_Handler, roots=tuple(self.roots))
        try:
            self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError:
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return int(self.server.server_address[1])


class _Handler(SimpleHTTPRequestHandler):
    def __init__(self, *args: object, roots: tuple[Path, ...], **kwargs: object) -> None:
        self.roots = roots
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def translate_path(self, path: str) -> str:
        clean = posixpath.normpath(urllib.parse.unquote(path.split("?", 1)[0].split("#", 1)[0]))
        target = Path(clean)
        if not any(target == root or root in target.parents for root in self.roots):
            return "/nonexistent"
        return clean + "/" if path.endswith("/") else clean

    def log_message(self, format: str, *args: object) -> None:
        pass


def local_folder(location: str) -> Path | None:
    """The folder a pip location names on this host (``file://`` URL or path), None for a remote one."""
    if location.startswith("file:"):
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(location).path))
    elif "://" in location:
        return None
    else:
        path = Path(location)
    return path if path.is_absolute() else path.resolve()


def build_args(settings: dict[str, str], mirror: Mirror) -> dict[str, str]:
    args: dict[str, str] = {}
    trusted = settings.get("trusted-host", "").split()
    for key in ("index-url", "extra-index-url", "find-links"):
        out = []
        for location in settings.get(key, "").split():
            folder = local_folder(location)
            if folder is None:
                out.append(location)
            elif folder.is_dir():
                out.append(mirror.url(folder, index=key != "find-links"))
        if out:
            args["PIP_" + key.upper().replace("-", "_")] = " ".join(out)
    if mirror.roots:
        trusted.append("127.0.0.1")
    if trusted:
        args["PIP_TRUSTED_HOST"] = " ".join(dict.fromkeys(trusted))
    for candidate in (settings.get("cert"), os.environ.get("REQUESTS_CA_BUNDLE"), os.environ.get("SSL_CERT_FILE"),
                      *DEFAULT_CA):
        if candidate and Path(candidate).is_file():
            args["CA_BUNDLE"] = candidate
            break
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="file the build arguments are written to")
    parser.add_argument("--port", type=int, default=0,
                        help="port to serve on (default: a free one). A fixed one keeps the build arguments, and so "
                             "Docker's layer cache, the same from one build to the next; a free one when it is taken")
    opts = parser.parse_args()
    mirror = Mirror()
    args = build_args(host_settings(), mirror)
    port = mirror.start(opts.port) if mirror.roots else 0
    text = "".join(f"{name}={value.replace('{port}', str(port))}\n" for name, value in args.items())
    partial = opts.out.with_name(opts.out.name + ".partial")
    partial.write_text(text)
    partial.replace(opts.out)
    for folder in mirror.roots:
        print(f"compose-pip-mirror: serving {folder} on http://127.0.0.1:{port}", file=sys.stderr)
    if not mirror.roots:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
