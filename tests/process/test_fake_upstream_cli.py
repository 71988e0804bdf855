"""``python -m sidecar.testing``: one log line per request, and the fault header by hand."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"


async def test_cli_logs_one_line_per_request_without_secrets() -> None:
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "sidecar.testing", "--port", "0"),
        *("--fail-first", "1", "--status", "503", "--retry-after", "2"),
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    out = proc.stdout

    async def line() -> str:
        return (await asyncio.wait_for(out.readline(), 15)).decode().rstrip("\n")

    try:
        url = (await line()).split()[-1]
        async with aiohttp.ClientSession() as http:
            async with http.post(url + CHAT, json={"model": "gpt-4o"}) as r:
                assert r.status == 503
            assert await line() == (
                f"#1 POST {CHAT} model=gpt-4o stream=false -> 503 "
                "[script: status=503 retry_after='2']"
            )
            headers = {
                "x-fake-fault": '{"status": 429, "body": "sk-body-canary"}',
                "authorization": "Bearer sk-header-canary",
            }
            body = {"model": "gpt-4o", "stream": True, "messages": "sk-body-canary"}
            async with http.post(url + CHAT, json=body, headers=headers) as r:
                assert (r.status, await r.text()) == (429, "sk-body-canary")
            assert await line() == (
                f"#2 POST {CHAT} model=gpt-4o stream=true -> 429 [x-fake-fault: status=429]"
            )
            async with http.get(url + "/v1/models?api_key=sk-query-canary") as r:
                assert r.status == 200
            assert await line() == "#3 GET /v1/models model=- stream=false -> 200 [default]"
    finally:
        proc.send_signal(signal.SIGINT)
        rest = (await asyncio.wait_for(out.read(), 15)).decode()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    assert rest == "stopping after 3 requests\n"


async def test_cli_quiet_logs_no_request_lines() -> None:
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "sidecar.testing", "--port", "0", "--quiet"),
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    try:
        first = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode()
        url = first.split()[-1]
        async with aiohttp.ClientSession() as http, http.get(url + "/v1/models") as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        rest = (await asyncio.wait_for(proc.stdout.read(), 15)).decode()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    assert rest == "stopping after 1 requests\n"


async def test_cli_name_takes_only_the_faults_aimed_at_it() -> None:
    """``--name primary``: ``x-fake-fault-for`` naming another fake leaves the answer
    (and the log line's source) as without the fault header (issue 23 item 7)."""
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "sidecar.testing", "--port", "0", "--name", "primary"),
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    out = proc.stdout

    async def line() -> str:
        return (await asyncio.wait_for(out.readline(), 15)).decode().rstrip("\n")

    try:
        url = (await line()).split()[-1]
        fault = {"x-fake-fault": '{"status": 503}'}
        async with aiohttp.ClientSession() as http:
            for aimed, status, source in (
                ("backup", 200, "[default]"),
                ("primary", 503, "[x-fake-fault: status=503]"),
            ):
                headers = {**fault, "x-fake-fault-for": aimed}
                async with http.post(url + CHAT, json={"model": "m"}, headers=headers) as r:
                    assert r.status == status
                assert (await line()).endswith(f"-> {status} {source}")
    finally:
        proc.send_signal(signal.SIGINT)
        rest = (await asyncio.wait_for(out.read(), 15)).decode()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    assert rest == "stopping after 2 requests\n"
