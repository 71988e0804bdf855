"""JSON-lines logging on stdout with the standard library.

One JSON object per line: ``ts`` (RFC 3339, UTC), ``level``, ``event`` and the
event's fields (passed as ``extra={"fields": {...}}`` or through :func:`event`).
Callers never pass URLs with credentials, keys, auth headers or bodies: the
fields logged are config names, counts, outcomes and times.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

LOGGER = logging.getLogger("sidecar")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object (``ts``, ``level``, ``event``, fields)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info and record.exc_info[0] is not None:
            out["error"] = record.exc_info[0].__name__
        return json.dumps(out, default=str)


def setup(level: str = "info") -> None:
    """Send ``sidecar`` and library logs to stdout as JSON lines at ``level``."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log is per request and not JSON-shaped fields; keep it off.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log event ``name`` with ``fields`` as one JSON line."""
    if LOGGER.isEnabledFor(level):
        LOGGER.log(level, name, extra={"fields": fields})
