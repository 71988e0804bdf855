"""The client's own deadline and retry count, as its request announces them (pure).

Contract, "Bounding the load that failures add": both official SDKs announce their
timeout on every request (``x-stainless-read-timeout``, seconds; the Anthropic SDK
also ``x-stainless-timeout``), and a client may send ``x-sidecar-timeout-ms``. The time
until the commit point is bounded by the smallest of ``request_timeout_ms`` and each
announced timeout less 5 % (at least 100 ms less), so that the client gets the
sidecar's 504 ``upstream_timeout`` (with ``x-should-retry: false``) before it gives up
and retries on its own. A request with ``x-stainless-retry-count`` of 1 or more is a
client's retry: the sidecar makes no retries of its own for it (it still falls back).
The headers are relayed upstream as received; nothing here changes them.

Values (an invalid one is ignored, as if it were absent; a value never fails a
request):

* ``x-stainless-read-timeout``, ``x-stainless-timeout``: seconds, a decimal number as
  the SDKs write it (``600``, ``2.0``, ``12.5``: Python's ``str`` of an int or a
  float); finite and > 0, else ignored (``0``, ``-1``, ``nan``, ``inf``, ``abc``).
* ``x-sidecar-timeout-ms``: milliseconds, ASCII digits only, > 0 (as Envoy's
  ``x-envoy-upstream-rq-timeout-ms``; ``0`` there means "no timeout": ignored here).
* ``x-stainless-retry-count``: ASCII digits; >= 1 is a client's retry.

Cost: on every request :func:`announced_timeout_s` makes three header lookups with
pre-made :class:`multidict.istr` keys (no scan of the header list); the retry count is
read only when a retry is about to be made (:func:`is_client_retry`), never on the path
of an answer that needs none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from multidict import istr

__all__ = [
    "MARGIN_MIN_S",
    "MARGIN_SHARE",
    "READ_TIMEOUT",
    "RETRY_COUNT",
    "SIDECAR_TIMEOUT_MS",
    "TIMEOUT",
    "announced_timeout_s",
    "is_client_retry",
    "time_to_answer_s",
]

READ_TIMEOUT = istr("x-stainless-read-timeout")
"""Both official SDKs (OpenAI's and Anthropic's, Stainless-generated): the read timeout."""
TIMEOUT = istr("x-stainless-timeout")
"""The Anthropic SDK: its timeout."""
SIDECAR_TIMEOUT_MS = istr("x-sidecar-timeout-ms")
"""Any client: its deadline in milliseconds."""
RETRY_COUNT = istr("x-stainless-retry-count")
"""Both official SDKs: how many times the SDK already retried this call (0 on its first)."""

MARGIN_SHARE = 0.05
"""The share of an announced timeout kept as a margin (contract: "less 5 %")."""
MARGIN_MIN_S = 0.1
"""The smallest margin in seconds (contract: "at least 100 ms less")."""


def time_to_answer_s(timeout_s: float) -> float:
    """The time the sidecar has to answer a client that gives up after ``timeout_s``
    seconds: ``timeout_s`` less ``max(5 %, 100 ms)``, never below 0 (a client whose
    timeout is within the margin gets the sidecar's 504 at once)."""
    left = timeout_s - max(timeout_s * MARGIN_SHARE, MARGIN_MIN_S)
    return left if left > 0.0 else 0.0


def _seconds(value: str) -> float | None:
    """A ``x-stainless-*timeout`` value in seconds, or None when it is not a finite
    decimal number > 0."""
    if not value.isascii():
        return None
    try:
        s = float(value)
    except ValueError:
        return None
    if not (s > 0.0 and math.isfinite(s)):  # also refuses nan
        return None
    return s


def announced_timeout_s(headers: Mapping[str, str]) -> float | None:
    """The smallest valid timeout the request announces, in seconds, or None.

    :param headers: the client's request headers (a case-insensitive multidict: the
        first value of each name is read).
    :returns: the least of ``x-stainless-read-timeout``, ``x-stainless-timeout`` (both
        seconds) and ``x-sidecar-timeout-ms`` / 1000, each ignored when invalid (see the
        module docstring); None when none is there and valid. No margin is taken here
        (:func:`time_to_answer_s` takes it).
    """
    best: float | None = None
    value = headers.get(READ_TIMEOUT)
    if value is not None:
        best = _seconds(value)
    value = headers.get(TIMEOUT)
    if value is not None and (s := _seconds(value)) is not None and (best is None or s < best):
        best = s
    value = headers.get(SIDECAR_TIMEOUT_MS)
    if value is not None and value.isascii() and value.isdigit() and (ms := int(value)) > 0:
        s = ms / 1000
        if best is None or s < best:
            best = s
    return best


def is_client_retry(headers: Mapping[str, str]) -> bool:
    """Whether the request is a client's retry: ``x-stainless-retry-count`` is ASCII
    digits worth 1 or more (an invalid value: not a retry)."""
    value = headers.get(RETRY_COUNT)
    return value is not None and value.isascii() and value.isdigit() and int(value) >= 1
