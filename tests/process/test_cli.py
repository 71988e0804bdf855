"""The command line as a subprocess: ``python -m sidecar check-config | serve``.

Exit codes (0 ok, 2 bad config or usage), every config error with its key path,
the effective config printed with credentials redacted, the missing
``api_key_env`` warning (check-config) or refusal (serve), ``SIDECAR__``
overrides, and one real ``serve`` run relaying a request until SIGTERM.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import aiohttp

import sidecar
from sidecar.testing import FakeUpstream

ROOT = Path(__file__).resolve().parents[2]
KEY_VAR = "CLI_TEST_OPENAI_KEY"
KEY_VALUE = "sk-env-value-never-printed"

BAD = """
[server]
listen = "nowhere"
bogus_server_key = 1

[upstreams.openai]
base_url = "https://user:pw-never-shown@example.com"
connect_timeout_ms = 0
[upstreams.openai.circuit_breaker]
cooldown_ms = 0
failure_threshold = -1

[upstreams.Bad-Name]
base_url = "https://x.example"

[[routes]]
name = "chat"
candidates = [{ upstream = "openai" }, { upstream = "bakup" }]

[[routes]]
name = "chat"
candidates = [{ upstream = "openai" }]
"""

GOOD = f"""
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"

[upstreams.openai]
base_url = "https://api.openai.com"
api_key_env = "{KEY_VAR}"
[upstreams.openai.headers]
Authorization = "Bearer hdr-secret-1"
"X-API-Key" = "hdr-secret-2"
"api-key" = "hdr-secret-3"
Cookie = "s=hdr-secret-4"
"x-team" = "blue"

[[routes]]
name = "chat"
candidates = [{{ upstream = "openai" }}]
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SIDECAR") and k not in (KEY_VAR, "OPENAI_API_KEY")
    }
    env.update(extra)
    return env


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        cwd=ROOT,
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )


def write(tmp_path: Path, text: str, name: str = "sidecar.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def effective(stdout: str) -> dict[str, Any]:
    return tomllib.loads(stdout)


def test_check_config_reports_every_error_with_its_key_path(tmp_path: Path) -> None:
    r = run("check-config", write(tmp_path, BAD))
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    expected = [
        "server.listen: ",
        "server.bogus_server_key: unknown key",
        "upstreams.openai.base_url: must not contain credentials",
        "upstreams.openai.connect_timeout_ms: must be > 0",
        "upstreams.openai.circuit_breaker.cooldown_ms: must be > 0",
        "upstreams.openai.circuit_breaker.failure_threshold: must be > 0",
        "upstreams.Bad-Name: name must match [a-z][a-z0-9_]*",
        'routes[0].candidates[1].upstream: no upstream named "bakup"',
        'routes[1].name: duplicate route name "chat"',
    ]
    for want in expected:
        assert any(want in line for line in lines), f"missing {want!r} in:\n{r.stderr}"
    assert not any("routes[0].name" in line for line in lines)  # the later route is named
    assert "pw-never-shown" not in r.stderr + r.stdout
    assert r.stdout == ""


def test_check_config_prints_the_effective_config_redacted(tmp_path: Path) -> None:
    r = run("check-config", write(tmp_path, GOOD), env=clean_env(**{KEY_VAR: KEY_VALUE}))
    assert r.returncode == 0, r.stderr
    assert "warning:" not in r.stderr
    out = r.stdout + r.stderr
    assert KEY_VALUE not in out
    for n in range(1, 5):
        assert f"hdr-secret-{n}" not in out
    doc = effective(r.stdout)
    up = doc["upstreams"]["openai"]
    headers = {k.lower(): v for k, v in up["headers"].items()}
    assert headers == {
        "authorization": "<redacted>",
        "x-api-key": "<redacted>",
        "api-key": "<redacted>",
        "cookie": "<redacted>",
        "x-team": "blue",
    }
    assert up["api_key_env"] == KEY_VAR
    # the effective config shows the defaults filled in
    assert up["connect_timeout_ms"] == 5000
    assert up["retry"]["max_retries"] == 2
    assert doc["server"]["max_request_body_bytes"] == 33554432
    assert doc["routes"][0]["candidates"] == [{"upstream": "openai"}]


def test_check_config_warns_about_a_missing_api_key_variable(tmp_path: Path) -> None:
    r = run("check-config", write(tmp_path, GOOD))
    assert r.returncode == 0
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert KEY_VAR in warnings[0]
    assert effective(r.stdout)["upstreams"]["openai"]["api_key_env"] == KEY_VAR


def test_check_config_with_an_empty_api_key_variable_warns_too(tmp_path: Path) -> None:
    r = run("check-config", write(tmp_path, GOOD), env=clean_env(**{KEY_VAR: ""}))
    assert r.returncode == 0
    assert any(line.startswith("warning:") and KEY_VAR in line for line in r.stderr.splitlines())


def test_serve_refuses_to_start_without_the_api_key_variable(tmp_path: Path) -> None:
    r = run("serve", "--config", write(tmp_path, GOOD))
    assert r.returncode == 2
    assert KEY_VAR in r.stderr
    assert '"started"' not in r.stdout  # no started event, however the JSON is spaced


def test_serve_with_a_bad_config_exits_2(tmp_path: Path) -> None:
    r = run("serve", "--config", write(tmp_path, BAD))
    assert r.returncode == 2
    assert 'routes[0].candidates[1].upstream: no upstream named "bakup"' in r.stderr


def test_env_overrides_show_in_check_config(tmp_path: Path) -> None:
    env = clean_env(
        SIDECAR__UPSTREAMS__OPENAI__RETRY__MAX_RETRIES="7",
        SIDECAR__UPSTREAMS__OPENAI__BASE_URL="http://10.0.0.7:8000",
        SIDECAR__SERVER__LISTEN="0.0.0.0:18080",
        SIDECAR__ROUTES__0__PATH_PREFIX="/v1/",
        **{KEY_VAR: KEY_VALUE},
    )
    r = run("check-config", write(tmp_path, GOOD), env=env)
    assert r.returncode == 0, r.stderr
    doc = effective(r.stdout)
    assert doc["upstreams"]["openai"]["retry"]["max_retries"] == 7
    assert doc["upstreams"]["openai"]["base_url"] == "http://10.0.0.7:8000"
    assert doc["server"]["listen"] == "0.0.0.0:18080"
    assert doc["routes"][0]["path_prefix"] == "/v1/"


def test_invalid_env_override_names_the_key_and_the_variable(tmp_path: Path) -> None:
    env = clean_env(SIDECAR__UPSTREAMS__OPENAI__CONNECT_TIMEOUT_MS="0")
    r = run("check-config", write(tmp_path, GOOD), env=env)
    assert r.returncode == 2
    assert any(
        "upstreams.openai.connect_timeout_ms: must be > 0" in line
        and "SIDECAR__UPSTREAMS__OPENAI__CONNECT_TIMEOUT_MS" in line
        for line in r.stderr.splitlines()
    ), r.stderr


def test_sidecar_config_env_names_the_file(tmp_path: Path) -> None:
    r = run("check-config", env=clean_env(SIDECAR_CONFIG=write(tmp_path, BAD)))
    assert r.returncode == 2
    assert "routes[0].candidates[1].upstream" in r.stderr


def test_embedded_default_is_valid() -> None:
    r = run("check-config")
    assert r.returncode == 0, r.stderr
    doc = effective(r.stdout)
    assert doc["upstreams"]["openai"]["base_url"] == "https://api.openai.com"
    assert doc["upstreams"]["anthropic"]["base_url"] == "https://api.anthropic.com"
    assert "api_key_env" not in doc["upstreams"]["openai"]


def test_version() -> None:
    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"sidecar {sidecar.__version__}\n"
    assert r.stdout.split()[1] == importlib.metadata.version("llm-circuit-sidecar")
    assert r.stderr == ""


def test_check_config_ends_with_a_summary_on_stderr(tmp_path: Path) -> None:
    r = run("check-config")
    assert r.returncode == 0, r.stderr
    # the embedded default: 2 upstreams, 3 routes, targets anthropic/* and openai/*
    assert r.stderr == "config ok: 2 upstreams, 3 routes, 2 breakers\n"
    assert effective(r.stdout)  # stdout is TOML and nothing else
    text = """
[upstreams.a]
base_url = "http://127.0.0.1:1"
[upstreams.a.circuit_breaker]
[upstreams.b]
base_url = "http://127.0.0.1:2"
[[routes]]
name = "one"
candidates = [{ upstream = "a", model = "x" }, { upstream = "a", model = "y" }, { upstream = "b" }]
[[routes]]
name = "two"
path_prefix = "/v2/"
candidates = [{ upstream = "a", model = "x" }, { upstream = "a" }]
"""
    r = run("check-config", write(tmp_path, text))
    assert r.returncode == 0, r.stderr
    # breakers: a/x, a/y, a/* (b has none; a/x counted once)
    assert r.stderr.splitlines() == ["config ok: 2 upstreams, 2 routes, 3 breakers"]
    assert effective(r.stdout)["routes"][1]["name"] == "two"
    warned = run(
        "check-config",
        write(
            tmp_path,
            text.replace(
                'base_url = "http://127.0.0.1:2"',
                'base_url = "http://127.0.0.1:2"\napi_key_env = "NOPE_UNSET"',
            ),
        ),
    )
    assert warned.returncode == 0
    lines = warned.stderr.splitlines()
    assert lines[0].startswith("warning: upstreams.b.api_key_env") and lines[-1].startswith(
        "config ok: "
    )
    bad = run("check-config", write(tmp_path, BAD))
    assert bad.returncode == 2 and "config ok" not in bad.stderr


def test_unreadable_file_and_bad_usage_exit_2(tmp_path: Path) -> None:
    r = run("check-config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2
    assert "missing.toml" in r.stderr
    assert run().returncode == 2
    assert run("no-such-command").returncode == 2
    assert run("check-config", write(tmp_path, "this is = = not toml")).returncode == 2


async def test_serve_relays_with_env_overrides_until_sigterm(
    tmp_path: Path, fake: FakeUpstream
) -> None:
    env = clean_env(
        SIDECAR__UPSTREAMS__OPENAI__BASE_URL=fake.url,
        SIDECAR__UPSTREAMS__OPENAI__HEADERS='{ "x-team" = "blue" }',
        **{KEY_VAR: KEY_VALUE},
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        "serve",
        "--config",
        write(tmp_path, GOOD),
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        port = None
        async with asyncio.timeout(15):
            while port is None:
                line = await proc.stdout.readline()
                assert line, "serve exited before it started"
                doc = json.loads(line)
                if doc.get("event") == "started":
                    port = doc["proxy_port"]
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            async with http.post(url, json={"model": "gpt-4o"}) as r:
                assert r.status == 200
                assert r.headers["x-sidecar-upstream"] == "openai"
                assert (await r.json())["choices"][0]["message"]["content"]
        rec = fake.requests[0]
        assert rec.headers.getall("Authorization") == [f"Bearer {KEY_VALUE}"]
        assert rec.headers.getall("x-team") == ["blue"]
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            rest, _ = await proc.communicate()
        assert proc.returncode == 0
        assert KEY_VALUE.encode() not in rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
