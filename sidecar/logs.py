"""JSON-lines logging on stdout with the standard library.

One JSON object per line: ``ts`` (RFC 3339, UTC), ``level``, ``event`` and the
event's fields (passed as ``extra={"fields": {...}}`` or through :func:`event`).
Callers never pass URLs with credentials, keys, auth headers or bodies: the
fields logged are config names, counts, outcomes and times.

:data:`HTTP_LOGGER` is the logger of the sidecar's own HTTP servers (aiohttp's
``logger=``): a malformed client request is a ``warning`` there (contract, "Logs"),
never aiohttp's ERROR with a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp.http_exceptions import HttpProcessingError

LOGGER = logging.getLogger("sidecar")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object (``ts``, ``level``, ``event``, fields).

    Encoded by orjson (the access log writes a line per request: the standard
    library's encoder costs about ten times as much); a value orjson refuses (a
    string with a lone surrogate, an integer over 64 bits) falls back to
    :func:`json.dumps`, so a line is never lost. ``ts`` is RFC 3339 in UTC with
    milliseconds; its date and time up to the second are formatted once per second.
    """

    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._prefix = ""
        self._heads: dict[tuple[str, str], bytes] = {}

    def line_bytes(self, created: float, level: str, event: str, fields: dict[str, Any]) -> bytes:
        """The same line as :meth:`line` (without ``error``), UTF-8, with its newline, made
        for the access log's line per request: ``fields`` is encoded alone and spliced
        after the head (no merged dict), with orjson's plain options (string keys).

        :param fields: a non-empty dict with string keys.
        """
        second = int(created)
        if second != self._second:
            self._prefix = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            self._second = second
        head = self._heads.get((level, event))
        if head is None:
            head = self._heads[(level, event)] = (
                b'+00:00","level":'
                + orjson.dumps(level)
                + b',"event":'
                + orjson.dumps(event)
                + b","
            )
        try:
            body = orjson.dumps(fields, option=orjson.OPT_APPEND_NEWLINE)
        except TypeError:
            return (self.line(created, level, event, fields) + "\n").encode()
        ts = f'{{"ts":"{self._prefix}.{int((created - second) * 1000):03d}'.encode()
        return ts + head + body[1:]

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        error = None
        if record.exc_info and record.exc_info[0] is not None:
            error = record.exc_info[0].__name__
        return self.line(
            record.created,
            record.levelname.lower(),
            record.getMessage(),
            fields if isinstance(fields, dict) else None,
            error,
        )

    def line(
        self,
        created: float,
        level: str,
        event: str,
        fields: dict[str, Any] | None,
        error: str | None = None,
    ) -> str:
        """The JSON line of one event (what :meth:`format` makes of a record).

        :param created: Unix time of the event, seconds.
        :param level: the level's name, lower case (``info``).
        :param error: the class name of the exception being logged, if any.
        """
        second = int(created)
        if second != self._second:
            self._prefix = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            self._second = second
        out: dict[str, Any] = {
            "ts": f"{self._prefix}.{int((created - second) * 1000):03d}+00:00",
            "level": level,
            "event": event,
        }
        if fields is not None:
            out.update(fields)
        if error is not None:
            out["error"] = error
        try:
            return orjson.dumps(out, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:
            return json.dumps(out, default=str)


LINES_FLUSH_S = 0.05
"""Seconds (wall, on the running event loop) a line written by
:meth:`StdoutHandler.write_line` may wait before it reaches stdout. Not a deadline of
any request: the access log's lines are batched so that stdout gets one ``write`` per
batch, not one per request (nginx's ``access_log ... buffer= flush=``, with a short
interval)."""
LINES_FLUSH_BYTES = 65536
"""Characters of pending lines that make :meth:`StdoutHandler.write_line` flush at once."""


class StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`setup` installs: JSON lines on stdout, plus :meth:`write_line`.

    :meth:`write_line` writes one line without a :class:`logging.LogRecord`: the
    access log's per-request line (:mod:`sidecar.access_log`) costs about a third
    as much that way (callgrind, a proxied JSON request: 63k instructions through
    ``Logger.handle``, 10k here). It writes exactly what :meth:`emit` would write
    for the same event, to the same stream, in order.

    Lines of :meth:`write_line` are batched: one ``write`` (a system call on the
    request path, after the answer was sent, so at concurrency 1 it delayed the
    client's next request) per :data:`LINES_FLUSH_S` or :data:`LINES_FLUSH_BYTES`,
    whichever comes first. A record through :meth:`emit` and :meth:`flush` (the
    logging module's at exit, the forced exit's) write the pending lines first, so
    stdout keeps the order in which lines were made. A process killed without a
    chance to flush (SIGKILL) loses at most the last :data:`LINES_FLUSH_S` of them.
    """

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._flush_at: asyncio.TimerHandle | None = None
        self._flush_loop: asyncio.AbstractEventLoop | None = None

    def write_line(self, level: str, event: str, fields: dict[str, Any]) -> None:
        """Write the line of event ``event`` at ``level`` (lower case) with ``fields`` now
        (on an event loop: within :data:`LINES_FLUSH_S`, batched with the next ones)."""
        formatter = self.formatter
        assert isinstance(formatter, JsonFormatter)
        # Unix time, as logging stamps a record (``LogRecord.created``): a display
        # value, like every other line's ``ts``, not a time that decides anything.
        text = formatter.line_bytes(time.time(), level, event, fields)
        with self.lock:  # type: ignore[union-attr]
            self._pending.append(text)
            self._pending_size += len(text)
            due = self._pending_size >= LINES_FLUSH_BYTES
            armed = self._flush_loop
            if not due and (self._flush_at is None or armed is None or armed.is_closed()):
                # (asyncio.get_running_loop costs a getpid system call: once per batch)
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    due = True  # no event loop: at once
                else:
                    self._flush_loop = loop
                    self._flush_at = loop.call_later(LINES_FLUSH_S, self.write_pending)
        if due:
            self.write_pending()

    def write_pending(self) -> None:
        """Write the lines :meth:`write_line` holds, in one ``write`` (then flush)."""
        with self.lock:  # type: ignore[union-attr]
            if self._flush_at is not None:
                self._flush_at.cancel()
                self._flush_at = None
            if not self._pending:
                return
            text = b"".join(self._pending).decode()
            self._pending = []
            self._pending_size = 0
            stream = self.stream
            try:
                stream.write(text)
                stream.flush()
            except Exception:
                self.handleError(logging.makeLogRecord({"msg": "request"}))

    def emit(self, record: logging.LogRecord) -> None:
        if self._pending:
            self.write_pending()
        super().emit(record)

    def flush(self) -> None:
        if self._pending:
            self.write_pending()
        super().flush()


STDOUT_HANDLER: StdoutHandler | None = None
"""The handler of the last :func:`setup`, or None before it."""


def setup(level: str = "info") -> None:
    """Send ``sidecar`` and library logs to stdout as JSON lines at ``level``."""
    global STDOUT_HANDLER
    if STDOUT_HANDLER is not None:
        STDOUT_HANDLER.write_pending()  # lines held by the handler being replaced
    handler = STDOUT_HANDLER = StdoutHandler(sys.stdout)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log is per request and not JSON-shaped fields; keep it off.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _demote_client_errors(record: logging.LogRecord) -> bool:
    """Filter of :data:`HTTP_LOGGER`: aiohttp's "Error handling request" for a request it
    could not parse (any :class:`HttpProcessingError`, answered 4xx by aiohttp) becomes
    one ``bad_client_request`` warning. Only the error's class is kept: aiohttp's message
    may quote request bytes, a credential header among them. Other errors (a handler's
    bug) stay as they are.
    """
    exc = record.exc_info[1] if record.exc_info else None
    if record.levelno < logging.WARNING or not isinstance(exc, HttpProcessingError):
        return True
    if not HTTP_LOGGER.isEnabledFor(logging.WARNING):
        return False
    record.levelno, record.levelname = logging.WARNING, "WARNING"
    record.msg, record.args = "bad_client_request", ()
    record.fields = {"error": type(exc).__name__, "status": exc.code or 400}
    record.exc_info = record.exc_text = None
    return True


HTTP_LOGGER = logging.getLogger("sidecar.http")
"""Passed to the proxy and admin servers (aiohttp's ``logger``); see the module docstring."""
HTTP_LOGGER.addFilter(_demote_client_errors)


def info_line(logger: logging.Logger, event: str, fields: dict[str, Any]) -> None:
    """Log ``event`` at INFO on ``logger`` with ``fields`` as one JSON line, cheaply.

    When the handler of :func:`setup` is the only one the record would reach (what
    ``Logger.callHandlers`` would find: no handler or filter on ``logger`` and its
    parents, only that handler on the root), the line is written straight to it
    (:meth:`StdoutHandler.write_line`, no ``LogRecord``); otherwise a record goes
    through ``logger.handle`` as ``Logger.info`` would make it, minus its caller
    lookup (``findCaller``). Used for the access log's line per request.
    """
    if not logger.isEnabledFor(logging.INFO):
        return
    direct = STDOUT_HANDLER
    if direct is not None and _only_destination(logger, direct):
        direct.write_line("info", event, fields)
        return
    record = logger.makeRecord(logger.name, logging.INFO, "", 0, event, (), None)
    record.fields = fields
    logger.handle(record)


def _only_destination(logger: logging.Logger, handler: StdoutHandler) -> bool:
    """Whether an INFO record of ``logger`` would reach ``handler`` and nothing else."""
    if logger.filters or handler.filters or handler.level > logging.INFO:
        return False
    node = logger
    while node.parent is not None:  # below the root
        if node.handlers or not node.propagate:
            return False
        node = node.parent
    handlers = node.handlers
    return len(handlers) == 1 and handlers[0] is handler


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log event ``name`` with ``fields`` as one JSON line."""
    if LOGGER.isEnabledFor(level):
        LOGGER.log(level, name, extra={"fields": fields})
