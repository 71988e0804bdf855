#!/usr/bin/env python3
"""Print a real ``/metrics`` scrape of the sidecar after some traffic.

Run with the project's venv from the repository root::

    .venv/bin/python deploy/tools/scrape_metrics.py > scrape.txt
    promtool check metrics < scrape.txt

It starts, in-process on loopback port 0, two fake upstreams and the real
sidecar in front of them (no network beyond 127.0.0.1), and drives a few
requests so that every kind of series has samples: successes, a retry, a
fallback after failures, a breaker opening, a rejection while open
(``circuit_open`` fallback), a connect error, a timeout, a broken response, a
429 and a 4xx relayed, an empty body, a mid-stream cut (a stream abort), no route
and a 400, a context-window 400 and an empty turn that each move on to the next
candidate (``context_window`` and ``empty_turn`` fallbacks, tokens not relayed):
every attempt outcome but ``cancelled``. It then prints
the admin port's ``/metrics`` body as a Prometheus server would get it
(``Accept: text/plain``, the classic text format promtool checks) and exits 0.
It exits 1 when the traffic did not produce the expected answers (the scrape
would not be representative).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import aiohttp

from sidecar.clock import LoopClock
from sidecar.config import parse_config
from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream, Fault, closed_port

PROMETHEUS_ACCEPT = "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
EMPTY_TURN = (
    b'{"id": "chatcmpl-empty", "object": "chat.completion", "created": 1, "model": "gpt-4o",'
    b' "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},'
    b' "finish_reason": "stop"}],'
    b' "usage": {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10}}'
)
"""A chat completion that ended its turn cleanly with nothing in it: an empty turn."""


def config_toml(primary: str, backup: str, dead: str) -> str:
    """The sidecar config: a breaker on ``primary`` that opens after one failed call."""
    return f"""
[upstreams.primary]
base_url = "{primary}"
first_byte_timeout_ms = 200
[upstreams.primary.retry]
max_retries = 1
backoff_initial_ms = 1
[upstreams.primary.circuit_breaker]
failure_threshold = 1
cooldown_ms = 60000

[upstreams.backup]
base_url = "{backup}"
[upstreams.backup.circuit_breaker]
failure_threshold = 5
cooldown_ms = 60000

# Its own upstream for the slow call: a success slower than 20 ms on a loaded
# machine would otherwise count against backup, whose breaker must stay closed.
[upstreams.slow]
base_url = "{backup}"
[upstreams.slow.circuit_breaker]
failure_threshold = 1000
cooldown_ms = 60000
slow_call_ms = 20

[upstreams.dead]
base_url = "{dead}"
[upstreams.dead.retry]
max_retries = 0

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary", model = "gpt-4o" }}, {{ upstream = "backup" }}]

[[routes]]
name = "direct"
path_prefix = "/direct/"
candidates = [{{ upstream = "backup" }}]

[[routes]]
name = "slow"
path_prefix = "/slow/"
candidates = [{{ upstream = "slow" }}]

[[routes]]
name = "broken"
path_prefix = "/broken/"
candidates = [{{ upstream = "dead" }}]

# The first candidate of "turns" answers from primary's fake, scripted per request
# (a context-window 400, then an empty turn); no breaker, so primary's stays as is.
[upstreams.turns]
base_url = "{primary}"
[upstreams.turns.retry]
max_retries = 0

[[routes]]
name = "turns"
path_prefix = "/turns/"
candidates = [{{ upstream = "turns" }}, {{ upstream = "backup" }}]

[[routes]]
name = "by_model"
path_prefix = "/models/"
models = ["smart"]
candidates = [{{ upstream = "backup", model = "gpt-4o-mini" }}]
"""


async def drive(http: aiohttp.ClientSession, sc: Sidecar, primary: FakeUpstream) -> list[str]:
    """Send the traffic; returns the problems seen (empty when all went as planned)."""
    problems: list[str] = []

    async def call(path: str, want: int, fault: str | None = None, **body: object) -> None:
        headers = {"x-fake-fault": fault} if fault else {}
        payload = {"model": "gpt-4o", "messages": [], **body}
        try:
            async with http.post(sc.proxy_url + path, json=payload, headers=headers) as r:
                await r.read()
                got = r.status
        except aiohttp.ClientPayloadError:
            got = -1  # the mid-stream cut: the client connection is aborted
        if got != want:
            problems.append(f"POST {path} (fault {fault}): status {got}, want {want}")

    for _ in range(3):
        await call("/v1/chat/completions", 200)
    await call("/v1/chat/completions", 200, stream=True)
    await call("/direct/chat/completions", 429, '{"status": 429}')
    await call("/direct/chat/completions", 404, '{"status": 404}')
    await call("/direct/chat/completions", 200, '{"empty_body": true}')
    await call("/direct/chat/completions", -1, '{"reset_after_chunks": 2}', stream=True)
    await call("/direct/chat/completions", 502, '{"reset_after_headers": true}')
    # a slow success (slow_call_ms = 20) and an error event before any output
    await call("/slow/chat/completions", 200, '{"delay_first_chunk_ms": 60}')
    await call("/direct/chat/completions", 200, '{"shape": "openai_server_error"}', stream=True)
    await call("/models/chat/completions", 200, model="smart")
    await call("/models/chat/completions", 404, model="unknown")  # no route lists it
    await call("/models/chat/completions", 400, model=None)  # a models route needs a model
    await call("/nowhere", 404)
    await call("/broken/chat/completions", 502)
    # primary: a 503 then a first-byte timeout (its retry) -> fallback to backup,
    # the breaker opens; the next request skips primary (a rejection).
    primary.script([Fault(status=503), Fault(delay_first_chunk_ms=1000)])
    await call("/v1/chat/completions", 200)
    await call("/v1/chat/completions", 200)
    # turns: a context-window 400, then an empty turn (and its retry, if any) from the
    # first candidate; backup answers both (fallbacks context_window and empty_turn).
    primary.script([Fault(shape="openai_context_window")])
    await call("/turns/chat/completions", 200)
    primary.script([Fault(body=EMPTY_TURN, content_type="application/json")] * 3)
    await call("/turns/chat/completions", 200)
    primary.script([])
    return problems


async def scrape() -> tuple[str, list[str]]:
    """Start everything, drive the traffic, return (the /metrics text, problems)."""
    async with FakeUpstream() as primary, FakeUpstream() as backup:
        toml = config_toml(primary.url, backup.url, f"http://127.0.0.1:{closed_port()}")
        sc = Sidecar(
            parse_config(toml, {}),
            environ={},
            clock=LoopClock(),  # real time: the first-byte timeout below is a real 200 ms
            proxy_listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
        )
        async with sc, aiohttp.ClientSession() as http:
            problems = await drive(http, sc, primary)
            async with http.get(
                sc.admin_url + "/metrics", headers={"Accept": PROMETHEUS_ACCEPT}
            ) as r:
                if r.status != 200:
                    problems.append(f"GET /metrics: status {r.status}")
                if not r.headers.get("Content-Type", "").startswith("text/plain"):
                    problems.append(f"GET /metrics: Content-Type {r.headers.get('Content-Type')}")
                text = await r.text()
    return text, problems


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the scrape to stdout (or ``--out``); problems go to stderr."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the scrape to this file instead of stdout")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the sidecar's JSON logs would mix with the scrape
    text, problems = asyncio.run(scrape())
    for p in problems:
        print(f"scrape_metrics: {p}", file=sys.stderr)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
