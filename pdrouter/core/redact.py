"""Secrets out of what is printed and logged: URLs with their credentials masked.

A Redis URL carries its password in the userinfo (``redis://:pw@host``, ``redis://user:pw@host``,
``rediss://…``, ``redis+cluster://:pw@a:7000,b:7001``) or in the query string (``?password=pw``,
as redis-py accepts); either is shown as ``***``. Use :func:`redact_url` wherever a URL may reach a
log line, a banner or an error message.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
SECRET_QUERY_KEYS = frozenset({"password", "pass", "pwd", "passwd", "secret", "token", "auth", "api_key",
                               "apikey", "key"})
"""Query parameters whose values are masked (compared case-insensitively)."""

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s]*@")
_SECRET_PARAM = re.compile(r"(?P<key>(?:^|[?&;])(?:" + "|".join(sorted(SECRET_QUERY_KEYS)) + r")=)[^&;#\s]*",
                           re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with the password of its userinfo and any secret query parameter replaced by ``***``.

    The user name stays (``redis://user:***@host:6379/0``); a userinfo with no colon is taken as
    a password alone, as Redis reads ``redis://pw@host`` (``redis://***@host``). A URL without
    credentials comes back unchanged. Never raises: text that does not parse as a URL has every
    ``scheme://…@`` userinfo and every secret ``key=value`` masked whole.
    """
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user, colon, _ = userinfo.partition(":")
            netloc = f"{user}:{MASK}@{hostport}" if colon else f"{MASK}@{hostport}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(k.lower() in SECRET_QUERY_KEYS for k, _ in pairs):
                query = urlencode([(k, MASK if k.lower() in SECRET_QUERY_KEYS else v) for k, v in pairs],
                                  safe="*")
        if netloc == parts.netloc and query == parts.query:
            return url
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        masked = _USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", url)
        return _SECRET_PARAM.sub(lambda m: f"{m.group('key')}{MASK}", masked)
