"""What the proxy checks in a request line and ``Host`` before it routes (pure functions).

Each check runs on a rare path only: the proxy calls them when a cheap test on the
common case fails (a ``Host`` not seen before, a request with no ``Content-Length``, a
path with ``/.`` in it), so a typical request pays a set lookup and a substring search.

* ``Host`` must be ``uri-host [ ":" port ]`` (RFC 9112 section 3.2: a server MUST answer
  400 to any other; RFC 3986 section 3.2.2 for ``uri-host``). The value is discarded
  anyway (the upstream gets its own), so this is conformance, not a defence.
* A request ``Transfer-Encoding`` must be ``chunked`` alone: the parser removes the
  chunked coding and nothing removes another, so ``gzip, chunked`` would reach the
  upstream still gzip-coded and labelled plain (RFC 9112 section 6.1: 501).
* Dot segments (``.``, ``..``, RFC 3986 section 3.3) in the path: a route's
  ``path_prefix`` is a confinement (a route may inject an API key), and the upstream gets
  the target as received, so the route must be the one the upstream's own reading of the
  path falls under. Upstreams read a path differently: some resolve dot segments (RFC
  3986 section 5.2.4), some also merge ``//``, some take ``%2F`` as a separator, some
  do none of this. :func:`path_readings` lists those readings; the proxy routes the
  request only when every reading picks the same route, and answers 400 otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote

from sidecar.answers import Failure

__all__ = ["has_dot_segment", "only_chunked", "path_readings", "valid_host"]

_HOST = re.compile(
    r"(?:\[[0-9A-Za-z:._~!$&'()*+,;=-]+\]"  # IP-literal (IPv6address, IPvFuture)
    r"|(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*)"  # IPv4address, reg-name
    r"(?::[0-9]*)?"  # port
)
"""``uri-host [ ":" port ]`` (RFC 9112 section 3.2, RFC 3986 section 3.2.2); the empty
value is allowed (RFC 9112 section 3.2: a target without authority)."""


KNOWN_HOSTS: set[str] = set()
"""``Host`` values seen valid (a client sends the same one every time): a request whose
``Host`` is in here needs no :func:`host_failure` call (the request path checks it
inline)."""
_HOSTS_MAX = 256


def host_failure(host: str | None) -> Failure | None:
    """Why a request's ``Host`` cannot be relayed (None: it can): absent (``NO_HOST``), or
    not a uri-host with an optional port (``INVALID_HOST``, RFC 9112 section 3.2). A
    valid value is remembered (at most 256), so the common case is one set lookup."""
    if host in KNOWN_HOSTS:
        return None
    if host is None:
        return Failure.NO_HOST
    if not valid_host(host):
        return Failure.INVALID_HOST
    if len(KNOWN_HOSTS) < _HOSTS_MAX:
        KNOWN_HOSTS.add(host)
    return None


def valid_host(value: str) -> bool:
    """Whether ``value`` is a valid ``Host`` field value (RFC 9112 section 3.2)."""
    return _HOST.fullmatch(value) is not None


def only_chunked(values: Iterable[str]) -> bool:
    """Whether the ``Transfer-Encoding`` field values list the ``chunked`` coding and no
    other (RFC 9112 section 6.1; names are case-insensitive, RFC 9112 section 7)."""
    codings = [c.strip().lower() for v in values for c in v.split(",")]
    return codings == ["chunked"]


def has_dot_segment(path: str) -> bool:
    """Whether the ``/``-separated ``path`` has a ``.`` or ``..`` segment (RFC 3986
    section 3.3)."""
    return any(segment in (".", "..") for segment in path.split("/"))


def remove_dot_segments(path: str) -> str:
    """``path`` with its dot segments resolved (RFC 3986 section 5.2.4), for an absolute
    path (``/`` first)."""
    out: list[str] = []
    segments = path.split("/")[1:]
    for i, segment in enumerate(segments):
        last = i == len(segments) - 1
        if segment == "..":
            if out:
                out.pop()
            if last:
                out.append("")
        elif segment == ".":
            if last:
                out.append("")
        else:
            out.append(segment)
    return "/" + "/".join(out)


_SLASHES = re.compile(r"//+")
_ENCODED_SLASH = re.compile(r"%2[Ff]")


def path_readings(path: str, raw_path: str) -> set[str]:
    """The paths an upstream may take ``raw_path`` for, percent-decoded as routes see them.

    :param path: the percent-decoded path (``request.path``), as routes match it today.
    :param raw_path: the path as received (no query).

    The readings: as decoded (an upstream that resolves nothing); dot segments resolved
    (RFC 3986 section 5.2.4); ``//`` merged then resolved (nginx's ``merge_slashes``, Go's
    ``path.Clean``); and both again with ``%2F`` kept inside its segment (most servers do
    not take an encoded slash for a separator, RFC 3986 section 2.2), decoded after.
    """
    # %2F kept as "%2F", every other escape decoded (%2e is a dot: RFC 3986 section 6.2.2.2)
    kept = "%2F".join(unquote(part) for part in _ENCODED_SLASH.split(raw_path))
    readings = {path, remove_dot_segments(path), remove_dot_segments(_SLASHES.sub("/", path))}
    for resolved in (remove_dot_segments(kept), remove_dot_segments(_SLASHES.sub("/", kept))):
        readings.add(unquote(resolved))
    return readings
