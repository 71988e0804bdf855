"""``sidecar demo`` end to end: a short run in a subprocess, as a newcomer would run it."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_shows_breaker_opening_closing_and_summary() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "demo", "--seconds", "8"],
        capture_output=True,
        text=True,
        timeout=25,
    )
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr)
    assert proc.stderr == ""  # no traceback, no unclosed-session or other warning
    assert "\x1b[" not in out  # not a terminal: no colour
    assert '"event"' not in out  # the sidecar's JSON logs stay off the screen
    opened = out.index("breaker OPENED on primary after 3 failed calls")
    probe = out.index("probe sent to primary", opened)
    closed = out.index("breaker CLOSED, primary is back in service", probe)
    summary = out.index("summary:", closed)
    rate = re.search(r"success rate seen by the app\s+(\d+)/(\d+)", out[summary:])
    assert rate is not None and rate[1] == rate[2] and int(rate[1]) > 30
    calls = re.search(r"calls to the failing provider: (\d+) instead of (\d+)", out)
    assert calls is not None and int(calls[1]) < int(calls[2])
    rows = re.findall(r"^\s+\d+s  (closed|OPEN|HALF-OPEN)", out, re.MULTILINE)
    assert "OPEN" in rows and rows[-1] == "closed"
