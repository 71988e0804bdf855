"""``sidecar serve`` as a process: the cause of a failed connection is on stdout at the
default ``log_level`` (contract, "Logs": ``upstream_attempt_failed`` at ``warning``, and
the access log's ``upstream_error``)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from sidecar.testing import closed_port
from tests.configs import config, route, upstream
from tests.rawhttp import RawConn
from tests.serve_proc import ServeProc, child_env

BODY = b'{"model":"gpt-4o"}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


async def test_a_refused_upstream_is_a_warning_at_the_default_level(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.toml"
    server = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "drain_timeout_ms": 500}
    assert "log_level" not in server  # the default: info
    upstreams = {"a": upstream(f"http://127.0.0.1:{closed_port()}", retry={"max_retries": 0})}
    path.write_text(config(server=server, upstreams=upstreams, routes=[route("r", "a")]))
    async with await ServeProc.start(path, child_env()) as sc:
        async with await RawConn.open(sc.proxy_port) as conn:
            await conn.send(REQUEST)
            assert (await conn.response()).status == 502
        warning = await sc.wait_for_event("upstream_attempt_failed")
        request = await sc.wait_for_event("request")
        sc.signal(signal.SIGTERM)
        assert await sc.wait(15) == 0
    assert {k: v for k, v in warning.items() if k != "ts"} == {
        "level": "warning",
        "event": "upstream_attempt_failed",
        "upstream": "a",
        "model": "*",
        "cause": "refused",
        "detail": "ClientConnectorError: [Errno 111] Connection refused",
    }
    assert (request["error"], request["upstream_error"]) == ("upstream_unavailable", "refused")
    assert "127.0.0.1" not in json.dumps(warning)
