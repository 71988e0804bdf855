"""The ``upstream_attempt_failed`` warning: a failed attempt's transport cause, rate limited.

Contract, "Logs": a failed attempt whose cause is a transport one (``dns``, ``refused``,
``tls``, ``proxy``, ``reset``, ``connect_timeout``, ``timeout``:
:data:`sidecar.causes.TRANSPORT_CAUSES`) is logged once per target and cause per minute
as ``upstream_attempt_failed`` at ``warning``, with ``upstream``, ``model``, ``cause`` and
``detail`` (the exception's class and the OS or TLS reason). The minute is read on the
injected clock; an HTTP answer (``http_503``), an ``sse_error`` or an ``empty_turn`` is
in the access log only.

Only failed attempts come here: a successful request costs nothing.
"""

from __future__ import annotations

import logging

from sidecar import logs
from sidecar.breakers.types import Target
from sidecar.causes import TRANSPORT_CAUSES
from sidecar.outcome import UpstreamError

INTERVAL_S = 60.0
"""At most one warning per target and cause in this many seconds (the contract's minute)."""

_KEEP = 1024
"""Entries kept before the expired ones are dropped (targets and causes are few)."""


class AttemptWarnings:
    """Logs ``upstream_attempt_failed`` at most once per (target, cause) per :data:`INTERVAL_S`.

    One per process (:class:`sidecar.proxy.Proxy`): a reload does not repeat a warning
    logged less than a minute ago.
    """

    def __init__(self) -> None:
        self._quiet_until: dict[tuple[Target, str], float] = {}

    def failed(self, target: Target, err: UpstreamError, now: float) -> bool:
        """An attempt on ``target`` failed with ``err`` at ``now`` (the clock's monotonic
        seconds): log it unless this target and cause were logged less than
        :data:`INTERVAL_S` ago, or its cause is not a transport one.

        :returns: whether a line was logged.
        """
        cause = err.cause
        if cause not in TRANSPORT_CAUSES:
            return False
        key = (target, cause)
        quiet = self._quiet_until
        until = quiet.get(key)
        if until is not None and now < until:
            return False
        if len(quiet) >= _KEEP:
            for k in [k for k, t in quiet.items() if t <= now]:
                del quiet[k]
        quiet[key] = now + INTERVAL_S
        logs.event(
            "upstream_attempt_failed",
            level=logging.WARNING,
            upstream=target.upstream,
            model=target.model,
            cause=cause,
            detail=err.detail,
        )
        return True
