"""``StdoutHandler.write_line`` writes what the handler writes for the same event as a record.

The access log's line skips the ``LogRecord`` (``sidecar.access_log``) when the stdout
handler of ``sidecar serve`` is its only destination; the line must not change for it.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from sidecar import access_log, logs

FIELDS = {"route": "chat", "method": "POST", "status": 200, "duration_ms": 1.5, "error": None}


@pytest.fixture
def stdout_setup(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """``logs.setup()`` on a captured stream, undone after the test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr(logs, "STDOUT_HANDLER", logs.STDOUT_HANDLER)  # put back after the test
    logs.setup("info")
    yield out
    root.handlers[:] = handlers
    root.setLevel(level)


def test_write_line_is_the_records_line(
    stdout_setup: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sidecar.logs.time.time", lambda: 1_800_000_000.25)
    handler = logs.STDOUT_HANDLER
    assert handler is not None
    handler.write_line("info", "request", FIELDS)
    record = logging.LogRecord("sidecar.access", logging.INFO, "", 0, "request", (), None)
    record.created, record.fields = 1_800_000_000.25, FIELDS
    handler.emit(record)
    first, second = stdout_setup.getvalue().splitlines()
    assert first == second
    head = '{"ts":"2027-01-15T08:00:00.250+00:00","level":"info","event":"request"'
    assert first.startswith(head)


def test_the_access_line_takes_the_record_path_when_another_handler_listens(
    stdout_setup: io.StringIO,
) -> None:
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    access_log._log(dict(FIELDS))  # the stdout handler alone: no record
    keep = Keep()
    access_log.ACCESS_LOGGER.addHandler(keep)
    try:
        access_log._log(dict(FIELDS))
    finally:
        access_log.ACCESS_LOGGER.removeHandler(keep)
    assert [r.getMessage() for r in seen] == ["request"]
    lines = stdout_setup.getvalue().splitlines()
    assert len(lines) == 2  # both lines reach stdout, the second through its record
    assert lines[0][lines[0].index('"level"') :] == lines[1][lines[1].index('"level"') :]
