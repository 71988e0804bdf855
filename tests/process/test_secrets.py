"""No secret ever leaks: canary values through every path, searched for everywhere.

Contract, "Logs": no log line, error body, metric or status entry ever contains an
upstream URL's credentials, an API key, an auth header, or a request or response
body; ``check-config`` prints variable names, never their values.

Canaries: the value of ``api_key_env``, the client's own credential headers, a
credential-like configured header, the request body, a key in the query string
(some providers take keys there; the access log never logs a query string), and
the password of a credentialed ``base_url`` (which must be refused without being
echoed). The access log is on, and its ``request`` lines are among those searched. The
main scenario runs ``sidecar serve`` as a child at ``log_level = "debug"`` and
drives success, retries, fallback, an open breaker, and errors of every kind
through it; then a bad reload, then SIGTERM. Every stdout and stderr line, every
answer the sidecar made itself (headers and body), ``/metrics``, ``/status``,
``/healthz`` and ``/readyz`` are searched. In-process runs are searched through
``caplog``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from sidecar.config import ConfigError, parse_config
from sidecar.logs import JsonFormatter
from sidecar.testing import FakeUpstream, Fault, closed_port
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar
from tests.rawhttp import RawConn
from tests.serve_proc import ROOT, ServeProc, child_env

KEY_VAR = "SIDECAR_TEST_CANARY_KEY"
KEY = "sk-canary-apikey-7f3a9c51"
CLIENT = "client-canary-b41e77d0"
HEADER = "hdr-canary-5d90ab13"
URL_PASSWORD = "url-canary-92d1c4e8"
BODY = "body-canary-0c6f2a97"
QUERY = "query-canary-e5a17c3b"
CANARIES = (KEY, CLIENT, HEADER, URL_PASSWORD, BODY, QUERY)
CREDENTIALED_URL = f"http://user:{URL_PASSWORD}@127.0.0.1:1"

CLIENT_HEADERS = {"Authorization": f"Bearer {CLIENT}", "x-api-key": CLIENT, "api-key": CLIENT}
PAYLOAD = {"model": "gpt-4o", "messages": [{"role": "user", "content": BODY}]}
STREAM = {**PAYLOAD, "stream": True}


def secrets_config(primary: str, backup: str, dead: str) -> str:
    """Five upstreams carrying every kind of secret (API key from the environment, a
    header value, credentials in ``primary``'s URL), five routes over them."""
    return config(
        server={
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "max_request_body_bytes": 4096,
            "request_timeout_ms": 5000,
            "drain_timeout_ms": 500,
            "log_level": "debug",
        },
        upstreams={
            "primary": upstream(
                primary,
                api_key_env=KEY_VAR,
                retry={"max_retries": 1, "backoff_initial_ms": 1, "backoff_max_ms": 1},
                circuit_breaker={"failure_threshold": 2, "cooldown_ms": 600000},
            ),
            "flaky": upstream(
                primary,
                api_key_env=KEY_VAR,
                auth_header="x-api-key",
                first_byte_timeout_ms=300,
                retry={"max_retries": 0},
            ),
            "backup": upstream(backup, headers={"x-api-key": HEADER, "x-team": "blue"}),
            "dead": upstream(
                dead,
                connect_timeout_ms=500,
                retry={"max_retries": 1, "backoff_initial_ms": 1},
            ),
        },
        routes=[
            route("chat", "primary", "backup", path_prefix="/v1/"),
            route("solo", "primary", path_prefix="/solo/"),
            route("flaky", "flaky", path_prefix="/flaky/"),
            route("dead", "dead", path_prefix="/dead/"),
            route("strict", "backup", path_prefix="/strict/", models=["gpt-4o"]),
        ],
    )


def assert_clean(where: str, text: str | bytes) -> None:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    for canary in CANARIES:
        assert canary not in text, f"{canary!r} leaked in {where}: {text[:2000]}"


class Seen:
    """Everything the sidecar said that must be free of canaries."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, where: str, text: str | bytes) -> None:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        self.items.append((where, text))


async def call(
    http: aiohttp.ClientSession,
    url: str,
    seen: Seen,
    *,
    json_body: object = PAYLOAD,
    data: bytes | None = None,
) -> int:
    """POST with the client canaries (a key in the query string too); record the
    sidecar's own answers (headers always)."""
    kwargs: dict[str, object] = {"data": data} if data is not None else {"json": json_body}
    kwargs["params"] = {"key": QUERY}
    async with http.post(url, headers=CLIENT_HEADERS, **kwargs) as r:  # type: ignore[arg-type]
        seen.add(f"headers of {url}", repr(list(r.headers.items())))
        try:
            body = await r.read()
        except aiohttp.ClientPayloadError:
            body = b""
        if "x-sidecar-error" in r.headers:
            seen.add(f"error body of {url}", body)
        return r.status


async def raw(port: int, data: bytes, seen: Seen) -> int:
    async with await RawConn.open(port) as conn:
        await conn.send(data)
        resp = await conn.response()
    seen.add(f"raw answer to {data[:40]!r}", repr(list(resp.headers.items())) + resp.body.decode())
    return resp.status


async def test_serve_scenarios_never_leak_a_canary(
    tmp_path: Path, fake: FakeUpstream, fake2: FakeUpstream
) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text(secrets_config(fake.url, fake2.url, f"http://127.0.0.1:{closed_port()}"))
    seen = Seen()
    async with (
        await ServeProc.start(path, child_env(**{KEY_VAR: KEY})) as sc,
        aiohttp.ClientSession() as http,
    ):
        v1 = sc.proxy_url + "/v1/chat/completions"
        # success, with the key injected upstream (the client's credentials dropped)
        assert await call(http, v1, seen) == 200
        assert fake.requests[-1].headers.getall("Authorization") == [f"Bearer {KEY}"]
        # a retry, then success
        fake.script([Fault(status=503), Fault()])
        assert await call(http, v1, seen) == 200
        # upstream errors relayed as they came (neutral for the breaker)
        fake.script([Fault(status=401)])
        assert await call(http, v1, seen) == 401
        fake.script([Fault(status=429, retry_after="1"), Fault(status=400)])
        assert await call(http, v1, seen) == 400
        # fallback twice: the primary's breaker opens (threshold 2)
        fake.script([Fault(status=503)] * 4)
        assert await call(http, v1, seen) == 200
        assert await call(http, v1, seen) == 200
        # breaker open: skipped at once, and 503 circuit_open where it is the only candidate
        assert await call(http, v1, seen) == 200
        assert await call(http, sc.proxy_url + "/solo/chat/completions", seen) == 503
        assert await call(http, sc.proxy_url + "/v1/messages", seen) == 200
        # 502: connect errors; 504: first-byte timeout; a stream cut mid-way
        assert await call(http, sc.proxy_url + "/dead/chat/completions", seen) == 502
        fake.script([Fault(stall=True)])
        assert await call(http, sc.proxy_url + "/flaky/chat/completions", seen) == 504
        fake.release()
        fake.script([Fault(reset_after_chunks=2)])
        assert (
            await call(http, sc.proxy_url + "/flaky/chat/completions", seen, json_body=STREAM)
            == 200
        )
        fake.script([Fault(reset_before_headers=True)])
        assert await call(http, sc.proxy_url + "/flaky/chat/completions", seen) == 502
        # the sidecar's own refusals
        assert await call(http, sc.proxy_url + "/nowhere", seen) == 404
        assert await call(http, sc.proxy_url + "/strict/x", seen, data=BODY.encode()) == 400
        big = b'{"model": "gpt-4o", "x": "' + BODY.encode() * 400 + b'"}'
        assert await call(http, v1, seen, data=big) == 413
        auth = f"Authorization: Bearer {CLIENT}\r\n".encode()
        assert (
            await raw(
                sc.proxy_port,
                b"GET http://evil.example/v1/x HTTP/1.1\r\nHost: a\r\n" + auth + b"\r\n",
                seen,
            )
            == 400
        )
        assert await raw(sc.proxy_port, b"GET /v1/x HTTP/1.0\r\n" + auth + b"\r\n", seen) == 400
        assert (
            await raw(
                sc.proxy_port,
                b"GET /v1/x HTTP/1.1\r\nHost: a\r\n" + auth + b"X-Bad: a\x00b\r\n\r\n",
                seen,
            )
            == 400
        )
        # a reload to a credentialed base_url is refused, and the running config stays
        path.write_text(secrets_config(CREDENTIALED_URL, fake2.url, fake2.url))
        sc.signal(signal.SIGHUP)
        failed = await sc.wait_for_event("config_reload_failed")
        assert "base_url" in str(failed)
        assert await call(http, v1, seen) == 200
        # the admin port
        for admin_path in ("/metrics", "/status?all=1", "/status", "/healthz", "/readyz"):
            async with http.get(sc.admin_url + admin_path) as r:
                seen.add(admin_path, await r.read())
        sc.signal()
        assert await sc.wait(10) == 0

    assert any(e.get("event") == "stream_aborted" for e in sc.events())
    assert any(e.get("event") == "breaker_opened" for e in sc.events())
    assert fake.requests[0].query_string == f"key={QUERY}"  # relayed, never logged
    # The access log covered every kind of ending searched below.
    outcomes = {e["outcome"] for e in sc.events() if e.get("event") == "request"}
    assert outcomes >= {
        "ok",
        "caller_error",
        "upstream_error",
        "circuit_open",
        "aborted",
        "rejected",
    }
    for where, text in seen.items:
        assert_clean(where, text)
    for line in sc.stdout:
        assert_clean("stdout", line)
    for line in sc.stderr:
        assert_clean("stderr", line)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )


def test_credentialed_base_url_is_refused_without_echo(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(secrets_config(CREDENTIALED_URL, "http://127.0.0.1:2", "http://127.0.0.1:3"))
    env = child_env(**{KEY_VAR: KEY})
    for args in (("check-config", str(bad)), ("serve", "--config", str(bad))):
        r = run_cli(*args, env=env)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "upstreams.primary.base_url" in r.stderr
        assert_clean(" ".join(args), r.stdout + r.stderr)


def test_credentialed_base_url_from_environment_is_refused_without_echo(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        secrets_config("http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3")
    )
    env = child_env(**{KEY_VAR: KEY, "SIDECAR__UPSTREAMS__BACKUP__BASE_URL": CREDENTIALED_URL})
    for args in (("check-config", str(good)), ("serve", "--config", str(good))):
        r = run_cli(*args, env=env)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "upstreams.backup.base_url" in r.stderr
        assert_clean(" ".join(args), r.stdout + r.stderr)


def test_check_config_prints_names_never_values(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        secrets_config("http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3")
    )
    r = run_cli("check-config", str(good), env=child_env(**{KEY_VAR: KEY}))
    assert r.returncode == 0, r.stderr
    assert KEY_VAR in r.stdout
    assert_clean("check-config", r.stdout + r.stderr)
    missing = run_cli("check-config", str(good), env=child_env())
    assert missing.returncode == 0
    assert f"warning: upstreams.primary.api_key_env: variable {KEY_VAR}" in missing.stderr
    assert_clean("check-config without the key", missing.stdout + missing.stderr)


def test_config_errors_in_process_never_echo_the_url() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            secrets_config(CREDENTIALED_URL, "http://127.0.0.1:2", "http://127.0.0.1:3"), {}
        )
    assert_clean("ConfigError", repr(info.value) + "\n".join(info.value.errors))


async def test_in_process_logs_never_leak(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    sc = await start_sidecar(
        secrets_config(fake.url, fake2.url, f"http://127.0.0.1:{closed_port()}"),
        environ={KEY_VAR: KEY},
    )
    seen = Seen()
    v1 = sc.proxy_url + "/v1/chat/completions"
    assert await call(http, v1, seen) == 200
    fake.script([Fault(status=503)] * 4)
    assert await call(http, v1, seen) == 200
    assert await call(http, sc.proxy_url + "/dead/x", seen) == 502
    fake.script([Fault(reset_after_chunks=2)])
    assert await call(http, sc.proxy_url + "/flaky/chat/completions", seen, json_body=STREAM) == 200
    assert (
        await raw(
            sc.proxy_port,
            b"GET /v1/x HTTP/1.1\r\nHost: a\r\nAuthorization: "
            + CLIENT.encode()
            + b"\r\nX-Bad: \x01\r\n\r\n",
            seen,
        )
        == 400
    )
    await asyncio.sleep(0)
    formatter = JsonFormatter()
    assert caplog.records, "nothing was logged"
    assert any(r.name == "sidecar.access" for r in caplog.records), "no access log line"
    for record in caplog.records:
        assert_clean("log record", formatter.format(record))
        assert_clean("log record fields", repr(record.__dict__))
    for where, text in seen.items:
        assert_clean(where, text)
