"""``sidecar serve`` as a process: what it writes when it cannot start, and for bad clients.

Contract ("Logs"): a start-up failure other than a config error (a port in use) is
one JSON log line with ``level`` ``error`` on stdout naming the cause, exit 1, and
nothing on stderr (no "Unclosed client session", no traceback). A malformed client
request is a ``warning`` at most, and never quotes the request.
"""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.configs import config, route, upstream
from tests.rawhttp import RawConn
from tests.serve_proc import ServeProc, child_env, serve_to_exit

CANARY = "sk-malformed-canary-31c07e"


def write_config(tmp_path: Path, listen: str, admin_listen: str, level: str = "info") -> Path:
    path = tmp_path / "sidecar.toml"
    server = {
        "listen": listen,
        "admin_listen": admin_listen,
        "drain_timeout_ms": 500,
        "log_level": level,
    }
    upstreams = {"a": upstream("http://127.0.0.1:1", circuit_breaker={})}
    path.write_text(config(server=server, upstreams=upstreams, routes=[route("r", "a")]))
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port with a listener on it (held until the test ends)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def log_lines(stdout: list[str]) -> list[dict[str, Any]]:
    """Every stdout line, each of which must be one JSON object."""
    docs = [json.loads(line) for line in stdout]
    assert all(isinstance(d, dict) for d in docs), stdout
    return docs


@pytest.mark.parametrize("key", ["listen", "admin_listen"])
async def test_a_port_in_use_is_one_error_line_and_exit_1(
    tmp_path: Path, busy_port: int, key: str
) -> None:
    busy = f"127.0.0.1:{busy_port}"
    listen, admin = (busy, "127.0.0.1:0") if key == "listen" else ("127.0.0.1:0", busy)
    code, out, err = await serve_to_exit(write_config(tmp_path, listen, admin), child_env())
    assert code == 1
    assert err == []
    errors = [d for d in log_lines(out) if d["level"] not in ("debug", "info")]
    assert errors == [
        {
            "ts": errors[0]["ts"],
            "level": "error",
            "event": "start_failed",
            "key": f"server.{key}",
            "listen": busy,
            "error": "EADDRINUSE",
            "detail": "Address already in use",
        }
    ]
    assert "started" not in [d["event"] for d in log_lines(out)]


MALFORMED = [
    # a header line without a colon
    (b"POST /v1/x HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer " + CANARY.encode() + b"\r\n"
     b"no colon " + CANARY.encode() + b"\r\n\r\n", 400),
    # a control character in a header value
    (b"POST /v1/x HTTP/1.1\r\nHost: a\r\nx-api-key: " + CANARY.encode() + b"\x01\r\n\r\n", 400),
    # Content-Length and Transfer-Encoding together (request smuggling)
    (b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n"
     b"Authorization: Bearer " + CANARY.encode() + b"\r\n\r\n0\r\n\r\n", 400),
    # a request line over the limit: 431, as the contract's table says
    (b"GET /" + CANARY.encode() * 400 + b" HTTP/1.1\r\nHost: a\r\n\r\n", 431),
    # a bad method, on a connection that already served a request (aiohttp logs a bad
    # method on a first request at debug: stray non-HTTP traffic)
    (b"G\x01T /" + CANARY.encode() + b" HTTP/1.1\r\nHost: a\r\n\r\n", 400),
]  # fmt: skip
GOOD = b"GET /v1/x HTTP/1.1\r\nHost: a\r\n\r\n"


async def test_malformed_client_requests_are_warnings_at_most(tmp_path: Path) -> None:
    config = write_config(tmp_path, "127.0.0.1:0", "127.0.0.1:0")
    async with await ServeProc.start(config, child_env()) as sc:
        for i, (data, status) in enumerate(MALFORMED):
            async with await RawConn.open(sc.proxy_port) as conn:
                if i == len(MALFORMED) - 1:
                    await conn.send(GOOD)
                    assert (await conn.response()).status == 502  # upstream refused
                await conn.send(data)
                assert (await conn.response()).status == status, data[:40]
            await sc.wait_for_event("bad_client_request")
        sc.signal(signal.SIGTERM)
        assert await sc.wait(15) == 0
    assert sc.stderr == []
    docs = log_lines(sc.stdout)
    assert [d for d in docs if d["level"] in ("error", "critical")] == []
    warnings = [d for d in docs if d["event"] == "bad_client_request"]
    assert len(warnings) == len(MALFORMED)
    for d, (_, status) in zip(warnings, MALFORMED, strict=True):
        assert d["level"] == "warning" and d["status"] == status
        assert set(d) == {"ts", "level", "event", "error", "status"}
    assert CANARY not in "\n".join(sc.stdout)
