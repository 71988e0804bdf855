"""An operator's override request, checked (pure): body, token, target path.

Contract, "The admin port": ``POST /breakers/{upstream}/{model}`` with
``Authorization: Bearer <token>`` and the JSON body ``{"action": "force_open" |
"force_closed" | "auto", "reason": "...", "for_ms": N}``. This module decides what a
request means; :mod:`sidecar.admin_breakers` answers it over HTTP, and the breakers
(:meth:`sidecar.breakers.live.LiveBreakers.apply_override`) carry it out.

Choices where the contract is silent (``docs/overrides.md``): ``reason`` is required for
``force_open`` and ``force_closed`` (it is what the next on-call engineer reads in
``/status`` and the logs), optional for ``auto``; ``for_ms`` is an integer of
milliseconds > 0 and at most :data:`MAX_FOR_MS` (a year), only with a ``force_*``
action; unknown keys are refused, as in the config (a typo such as ``"for": 600000``
would otherwise be an override without an end).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import NamedTuple

from sidecar.breakers.types import ACTIONS, AUTO

MAX_REASON_CHARS = 500
"""Longest ``reason`` accepted (characters)."""
MAX_FOR_MS = 365 * 24 * 3600 * 1000
"""Longest ``for_ms`` accepted: one year, in milliseconds."""
BODY_KEYS = frozenset({"action", "reason", "for_ms"})


class OverrideRequest(NamedTuple):
    """A valid override request: ``action`` (one of :data:`ACTIONS`), ``reason`` and
    ``for_ms`` (milliseconds > 0, or None: until ``auto``)."""

    action: str
    reason: str
    for_ms: int | None


class BadRequest(ValueError):
    """The request body is not a valid override (the message says why, for a 400)."""


def admin_token(token_env: str, environ: Mapping[str, str]) -> str | None:
    """The admin token: the value of the variable named ``token_env``
    (``server.admin_token_env``), read from ``environ``; None when the name is "" or the
    variable is unset or empty (the write endpoints then do not exist)."""
    if not token_env:
        return None
    return environ.get(token_env) or None


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <token>``, compared in
    constant time (:func:`hmac.compare_digest`, RFC 6750 section 2.1 for the scheme,
    whose name is case-insensitive per RFC 9110 section 11.1). Both are compared as the
    bytes they came as: a header's octets that are not UTF-8 (aiohttp keeps them as
    surrogate escapes, as :data:`os.environ` does for the token) are a wrong token,
    never an error."""
    if header is None:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    raw = given.strip().encode("utf-8", "surrogateescape")
    return hmac.compare_digest(raw, token.encode("utf-8", "surrogateescape"))


def parse_body(doc: object) -> OverrideRequest:
    """Check a decoded JSON body.

    :raises BadRequest: not an object, an unknown key, an unknown ``action``, a missing
        or empty ``reason`` on a ``force_*`` action, ``for_ms`` not an integer in
        1..:data:`MAX_FOR_MS`, or ``for_ms`` with ``auto``.
    """
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(str(k) for k in doc if k not in BODY_KEYS)
    if unknown:
        raise BadRequest(f"unknown key(s) {', '.join(unknown)}: expected action, reason, for_ms")
    action = doc.get("action")
    if action not in ACTIONS:
        raise BadRequest("action must be one of force_open, force_closed, auto")
    assert isinstance(action, str)
    reason = doc.get("reason", "")
    if not isinstance(reason, str):
        raise BadRequest("reason must be a string")
    reason = reason.strip()
    if len(reason) > MAX_REASON_CHARS:
        raise BadRequest(f"reason must be at most {MAX_REASON_CHARS} characters")
    if not reason and action != AUTO:
        raise BadRequest(f"reason is required for {action} (what the next operator will read)")
    for_ms = doc.get("for_ms")
    if for_ms is not None:
        if action == AUTO:
            raise BadRequest("for_ms applies to force_open and force_closed only")
        if isinstance(for_ms, bool) or not isinstance(for_ms, int):
            raise BadRequest("for_ms must be an integer number of milliseconds")
        if not 0 < for_ms <= MAX_FOR_MS:
            raise BadRequest(f"for_ms must be > 0 and at most {MAX_FOR_MS} (one year)")
    return OverrideRequest(action, reason, for_ms)
