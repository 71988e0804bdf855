"""``sidecar demo`` end to end: a short run in a subprocess, as a newcomer would run it."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_shows_breaker_opening_closing_and_summary() -> None:
    proc = subprocess.run(
        # 12 s: the stalled probe is released by the recovery at 7.0 s, on a row's
        # tick (as in the default 30 s run), where a row could show a stale state.
        [sys.executable, "-m", "sidecar", "demo", "--seconds", "12"],
        capture_output=True,
        text=True,
        timeout=30,
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
    # Every row shows the state of the last breaker event printed above it.
    implied = {"OPENED": "OPEN", "OPEN again": "OPEN", "HALF-OPEN": "HALF-OPEN"}
    implied["CLOSED"] = "closed"
    last = "closed"
    for line in out[: out.index("summary:")].splitlines():
        row = re.match(r"^\s+\d+s  (closed|OPEN|HALF-OPEN)", line)
        if row:
            assert row[1] == last, (line, out)
        elif line.lstrip().startswith(">>"):
            last = next((v for k, v in implied.items() if k in line), last)
