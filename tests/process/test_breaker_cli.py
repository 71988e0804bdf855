"""``sidecar breaker open|close|auto`` as a subprocess against a running ``sidecar serve``.

What an operator types and sees: the verb's printed result and exit code, the running
sidecar's ``/status`` and log, and where its traffic goes (fake upstreams on loopback,
in this process). Errors each have their exit code: 2 usage or config, 3 the admin port
unreachable, 4 token refused, 5 endpoint off or unknown target. The token appears in
nothing printed or logged.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from sidecar.testing import FakeUpstream, closed_port
from tests.configs import config, route, upstream
from tests.serve_proc import ROOT, ServeProc, child_env

TOKEN_VAR = "SIDECAR_CLI_ADMIN_TOKEN"
TOKEN = "adm-cli-tok-7Hq2SECRET"
RUN_S = 20.0


def serve_config(primary: str, backup: str, admin_listen: str = "127.0.0.1:0") -> str:
    cb = {"failure_threshold": 1, "cooldown_ms": 10_000}
    return config(
        server={
            "listen": "127.0.0.1:0",
            "admin_listen": admin_listen,
            "admin_token_env": TOKEN_VAR,
        },
        upstreams={
            "primary": upstream(primary, retry={"max_retries": 0}, circuit_breaker=cb),
            "backup": upstream(backup, retry={"max_retries": 0}),
        },
        routes=[
            route("chat", {"upstream": "primary", "model": "gpt-4o"}, "primary", "backup"),
        ],
    )


async def cli(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """``python -m sidecar breaker ARGS``: (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        "breaker",
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(RUN_S):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest_asyncio.fixture
async def served(
    tmp_path: Path, fake: FakeUpstream, fake2: FakeUpstream
) -> AsyncIterator[tuple[ServeProc, Path]]:
    """A ``sidecar serve`` child with the admin token set, and its config file."""
    path = tmp_path / "sidecar.toml"
    path.write_text(serve_config(fake.url, fake2.url))
    proc = await ServeProc.start(path, child_env(**{TOKEN_VAR: TOKEN}))
    try:
        yield proc, path
    finally:
        proc.signal()
        await proc.wait(10.0)


async def status(admin_url: str) -> dict[str, dict[str, object]]:
    async with aiohttp.ClientSession() as http, http.get(f"{admin_url}/status") as r:
        body = await r.json()
    return {f"{b['upstream']}/{b['model']}": b for b in body["breakers"]}


async def served_by(proxy_url: str) -> str:
    """One request (model "m": the candidate primary/gpt-4o rewrites it, primary/* not)."""
    doc = {"model": "m", "messages": []}
    connector = aiohttp.TCPConnector(force_close=True)
    url = f"{proxy_url}/v1/chat/completions"
    async with aiohttp.ClientSession(connector=connector) as http, http.post(url, json=doc) as r:
        assert r.status == 200
        return r.headers["x-sidecar-upstream"]


async def test_open_close_and_auto_from_the_command_line(
    served: tuple[ServeProc, Path], fake: FakeUpstream
) -> None:
    proc, path = served
    env = child_env(**{TOKEN_VAR: TOKEN})
    common = ("--config", str(path), "--admin", proc.admin_url)

    code, out, err = await cli(
        "open", "primary", "gpt-4o", "--reason", "maintenance", "--for", "10m", *common, env=env
    )
    assert (code, err) == (0, "")
    assert out.startswith("primary/gpt-4o: force_open until 20")
    assert "reason: maintenance" in out
    entry = (await status(proc.admin_url))["primary/gpt-4o"]
    assert entry["state"] == "open"
    ov = entry["override"]
    assert isinstance(ov, dict)
    assert (ov["action"], ov["reason"], ov["for_ms"]) == ("force_open", "maintenance", 600_000)
    assert await served_by(proc.proxy_url) == "primary"  # the next candidate: primary/*
    assert fake.requests[-1].json()["model"] == "m"  # primary/gpt-4o was skipped
    logged = await proc.wait_for_event("breaker_override")
    assert {k: logged[k] for k in ("upstream", "model", "action", "reason", "for_ms")} == {
        "upstream": "primary",
        "model": "gpt-4o",
        "action": "force_open",
        "reason": "maintenance",
        "for_ms": 600_000,
    }

    # '*' is a target without a model; close = force_closed; --json prints the entry.
    code, out, err = await cli(
        "close", "primary", "*", "--reason", "misjudged", "--json", *common, env=env
    )
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["model"], doc["state"], doc["override"]["action"]) == (
        "*",
        "closed",
        "force_closed",
    )

    code, out, err = await cli("auto", "primary", "gpt-4o", *common, env=env)
    assert (code, err) == (0, "")
    assert out.startswith("primary/gpt-4o: back to its breaker's own rules (state closed")
    assert "override" not in (await status(proc.admin_url)).get("primary/gpt-4o", {})
    assert await served_by(proc.proxy_url) == "primary"
    assert fake.requests[-1].json()["model"] == "gpt-4o"

    everything = "\n".join(proc.stdout + proc.stderr)
    assert TOKEN not in everything


async def test_each_failure_has_its_exit_code_and_says_what_to_do(
    served: tuple[ServeProc, Path], tmp_path: Path
) -> None:
    proc, path = served
    env = child_env(**{TOKEN_VAR: TOKEN})
    common = ("--config", str(path), "--admin", proc.admin_url)
    args = ("open", "primary", "gpt-4o", "--reason", "m")

    code, _, err = await cli(*args, *common, env=child_env(**{TOKEN_VAR: "wrong-tok-Q1"}))
    assert code == 4 and "401" in err and TOKEN_VAR in err
    assert "wrong-tok-Q1" not in err

    code, _, err = await cli("open", "nope", "*", "--reason", "m", *common, env=env)
    assert code == 5 and "no breaker for nope/*" in err

    code, _, err = await cli(
        *args, "--config", str(path), "--admin", f"http://127.0.0.1:{closed_port()}", env=env
    )
    assert code == 3 and "cannot reach the admin port" in err

    code, _, err = await cli(*args, "--for", "10", *common, env=env)
    assert code == 2 and "--for" in err
    code, _, err = await cli("auto", "primary", "gpt-4o", "--for", "1h", *common, env=env)
    assert code == 2 and "--for" in err
    code, _, err = await cli(*args, *common, env=child_env())
    assert code == 2 and f"variable {TOKEN_VAR} is not set" in err
    code, _, err = await cli("open", "primary", "gpt-4o", *common, env=env)  # no reason
    assert code == 1 and "reason is required" in err

    no_token = tmp_path / "no-token.toml"
    no_token.write_text(path.read_text().replace(f'admin_token_env = "{TOKEN_VAR}"', ""))
    code, _, err = await cli(*args, "--config", str(no_token), "--admin", proc.admin_url, env=env)
    assert code == 2 and "server.admin_token_env is not set" in err

    assert "override" not in (await status(proc.admin_url)).get("primary/gpt-4o", {})
    assert TOKEN not in "\n".join(proc.stdout + proc.stderr)


async def test_the_address_from_the_config_and_an_endpoint_that_is_off(
    tmp_path: Path, fake: FakeUpstream, fake2: FakeUpstream
) -> None:
    # The sidecar runs without the token variable: its endpoint does not exist. The CLI
    # finds the config through SIDECAR_CONFIG and the port in server.admin_listen
    # (0.0.0.0 reached on loopback).
    port = closed_port()
    path = tmp_path / "sidecar.toml"
    path.write_text(serve_config(fake.url, fake2.url, admin_listen=f"0.0.0.0:{port}"))
    proc = await ServeProc.start(path, child_env())
    try:
        env = child_env(**{TOKEN_VAR: TOKEN, "SIDECAR_CONFIG": str(path)})
        code, _, err = await cli("open", "primary", "*", "--reason", "m", env=env)
        assert code == 5 and "no override endpoint" in err
    finally:
        proc.signal()
        assert await proc.wait(10.0) == 0


@pytest.mark.parametrize("text", ["10m", "90s", "2h", "1500ms", "1h30m", "365d"])
def test_durations(text: str) -> None:
    from sidecar.breaker_cli import parse_duration_ms

    want = {"10m": 600_000, "90s": 90_000, "2h": 7_200_000, "1500ms": 1500, "1h30m": 5_400_000}
    want["365d"] = 365 * 86_400_000
    assert parse_duration_ms(text) == want[text]


@pytest.mark.parametrize(
    "text", ["", "10", "0s", "10 m", "-5s", "1.5h", "m", "10x", "10M", "2H", "400d", "366d"]
)
def test_bad_durations(text: str) -> None:
    from sidecar.breaker_cli import parse_duration_ms

    with pytest.raises(ValueError, match="duration"):
        parse_duration_ms(text)


def test_check_config_warns_of_an_unset_token_variable_and_never_prints_its_value(
    tmp_path: Path,
) -> None:
    import subprocess

    path = tmp_path / "sidecar.toml"
    path.write_text(serve_config("http://127.0.0.1:9", "http://127.0.0.1:9"))

    def check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sidecar", "check-config", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_S,
            check=False,
        )

    r = check(child_env())
    assert r.returncode == 0
    assert f"warning: server.admin_token_env: variable {TOKEN_VAR} is not set" in r.stderr
    assert f'admin_token_env = "{TOKEN_VAR}"' in r.stdout  # the name, in the effective config
    r = check(child_env(**{TOKEN_VAR: TOKEN}))
    assert (r.returncode, "warning" in r.stderr) == (0, False)
    assert TOKEN not in r.stdout + r.stderr


async def test_the_token_never_goes_to_an_http_proxy_of_the_environment(
    served: tuple[ServeProc, Path],
) -> None:
    """A sidecar container reaching its providers through an egress proxy has
    ``HTTP_PROXY`` set (docs/egress.md), and ``kubectl exec`` runs the verb with that
    environment: the admin port is this pod's own, so the request (its ``Authorization:
    Bearer`` token in clear) goes straight to it, never to the proxy."""
    proc, path = served
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.read(65536))
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    via = f"http://127.0.0.1:{port}"
    env = child_env(**{TOKEN_VAR: TOKEN, "HTTP_PROXY": via, "http_proxy": via})
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    try:
        code, out, err = await cli(
            "auto", "primary", "gpt-4o", "--config", str(path), "--admin", proc.admin_url, env=env
        )
    finally:
        server.close()
        await server.wait_closed()
    assert seen == []
    assert (code, err) == (0, "")
    assert out.startswith("primary/gpt-4o: ")
