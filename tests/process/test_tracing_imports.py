"""Without ``[tracing]`` nothing of OpenTelemetry is imported (contract, "Traces": the
table is optional and "absent = no tracing, nothing imported").

A fresh interpreter builds and starts the sidecar, serves a request (a real one, to a
port that refuses: the whole request path runs, attempts included), stops it, and
lists the ``opentelemetry`` modules it imported. With ``[tracing]`` the same program
imports them (the check can fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from sidecar.testing.net import closed_port
from tests.configs import config, route, upstream

PROGRAM = textwrap.dedent(
    """
    import asyncio, json, sys
    import aiohttp
    from sidecar.config import parse_config
    from sidecar.server import Sidecar

    async def main() -> None:
        sc = Sidecar(parse_config(sys.argv[1], {}), environ={},
                     proxy_listen="127.0.0.1:0", admin_listen="127.0.0.1:0")
        await sc.start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(sc.proxy_url + "/v1/chat/completions",
                                     json={"model": "m"}) as r:
                    assert r.status == 502, r.status
                async with http.get(sc.admin_url + "/metrics") as r:
                    assert r.status == 200
        finally:
            await sc.stop()

    asyncio.run(main())
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")))
    """
)


def imported(toml: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, toml],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    modules: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return modules


@pytest.mark.timeout(120)
def test_without_tracing_nothing_of_opentelemetry_is_imported() -> None:
    base = f"http://127.0.0.1:{closed_port()}"
    plain = config(
        upstreams={"primary": upstream(base, retry={"max_retries": 0})},
        routes=[route("chat", "primary")],
    )
    assert imported(plain) == []
    traced = config(
        upstreams={"primary": upstream(base, retry={"max_retries": 0})},
        routes=[route("chat", "primary")],
        tracing={"otlp_endpoint": f"http://127.0.0.1:{closed_port()}/v1/traces"},
    )
    assert "opentelemetry.sdk.trace" in imported(traced)
