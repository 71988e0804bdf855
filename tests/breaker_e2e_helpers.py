"""Helpers shared by the black-box breaker tests (tests/e2e/test_breaker_e2e_*.py).

Config tables (for tests/configs.py), one-call client helpers and bounded waits. Every wait
here is bounded: by a number of event-loop turns, or by :func:`asyncio.timeout`
around a wait on the fake upstream's own state (never a wall-clock sleep).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any

import aiohttp
from multidict import CIMultiDict

from sidecar.server import Sidecar
from sidecar.testing import FAULT_HEADER, FakeClock, FakeUpstream, Fault
from tests import configs
from tests.conftest import StartSidecar, status

WAIT_S = 5.0
"""Upper bound on any wait for the fake upstream's state (a failure, not a pace)."""


# The breaker tests' tables as data, for tests.configs (``config(server=SERVER_TABLE, ...)``).
SERVER_TABLE: Mapping[str, Any] = MappingProxyType({"drain_timeout_ms": 200})
_NO_KEYS: Mapping[str, Any] = MappingProxyType({})


def breaker_table(
    threshold: int = 1, cooldown_ms: int = 10_000, probes: int = 1, successes: int = 1, **more: Any
) -> dict[str, Any]:
    """A ``circuit_breaker`` table as data (``more``: further keys, e.g. ``slow_call_ms``)."""
    return {
        "failure_threshold": threshold,
        "cooldown_ms": cooldown_ms,
        "half_open_max_probes": probes,
        "success_threshold": successes,
        **more,
    }


def chain_upstream(
    url: str,
    *,
    breaker: Mapping[str, Any] | None = _NO_KEYS,
    retries: int = 0,
    retry_keys: Mapping[str, Any] = _NO_KEYS,
    **keys: Any,
) -> dict[str, Any]:
    """An upstream table for tests.configs: a retry table of ``retries`` (plus
    ``retry_keys``) and ``backoff_initial_ms = 1`` (retry backoff sleeps on the FakeClock
    and so moves it; 1 ms keeps that far below every cooldown used here), and breaker
    table ``breaker`` (an empty one, all defaults, unless given; None: none)."""
    retry = {"max_retries": retries, "backoff_initial_ms": 1, "backoff_max_ms": 1, **retry_keys}
    return configs.upstream(url, retry=retry, circuit_breaker=breaker, **keys)


async def start_chain(
    start_sidecar: StartSidecar,
    primary_url: str,
    cb: Mapping[str, Any] | None,
    backup_url: str | None = None,
    *,
    retries: int = 0,
    primary_keys: Mapping[str, Any] = _NO_KEYS,
    retry_keys: Mapping[str, Any] = _NO_KEYS,
) -> Sidecar:
    """The sidecar with one route "chat": ``primary`` (breaker ``cb``; None: none), then ``backup``.

    ``backup`` (no breaker) is configured only when ``backup_url`` is given;
    ``primary_keys`` and ``retry_keys`` go into the primary's table and its retry table.
    """
    upstreams = {
        "primary": chain_upstream(
            primary_url, breaker=cb, retries=retries, retry_keys=retry_keys, **primary_keys
        )
    }
    if backup_url is not None:
        upstreams["backup"] = chain_upstream(backup_url, breaker=None)
    text = configs.config(
        server=SERVER_TABLE,
        upstreams=upstreams,
        routes=[configs.route("chat", *upstreams, path_prefix="/v1/")],
    )
    return await start_sidecar(text)


async def served_by(http: aiohttp.ClientSession, sc: Sidecar, n: int) -> Counter[str]:
    """``n`` healthy calls one after another (each must answer 200): how many each
    upstream answered (``x-sidecar-upstream``)."""
    got: Counter[str] = Counter()
    for _ in range(n):
        r = await call(http, sc)
        assert r.status == 200, r
        got[r.headers["x-sidecar-upstream"]] += 1
    return got


@dataclass
class Resp:
    """A response read to its end."""

    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def call(
    http: aiohttp.ClientSession,
    sc: Sidecar,
    path: str = "/v1/chat/completions",
    *,
    model: str = "m",
    fault: Mapping[str, Any] | None = None,
    body: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> Resp:
    """POST a JSON body to the proxy; ``fault`` goes to the fake as ``x-fake-fault``."""
    h = dict(headers or {})
    if fault is not None:
        h[FAULT_HEADER] = json.dumps(fault)
    doc = dict(body) if body is not None else {"model": model, "messages": []}
    async with http.post(sc.proxy_url + path, json=doc, headers=h) as r:
        data = await r.read()
        return Resp(r.status, CIMultiDict(r.headers), data)


def fail(status: int = 503, **more: Any) -> dict[str, Any]:
    """An ``x-fake-fault`` value: a failing status (more Fault fields as keywords)."""
    return {"status": status, **more}


async def entry(http: aiohttp.ClientSession, sc: Sidecar, key: str = "primary/*") -> dict[str, Any]:
    """The ``/status?all=1`` entry of one target (KeyError when it has no breaker)."""
    entries = await status(http, sc)
    return dict(entries[key])


async def until_fake(fake: FakeUpstream, predicate: Callable[[], bool]) -> None:
    """Wait (bounded) until ``predicate()`` holds on the fake upstream's state."""
    async with asyncio.timeout(WAIT_S):
        await fake.wait_until(predicate)


async def start_slow(
    http: aiohttp.ClientSession,
    sc: Sidecar,
    fake: FakeUpstream,
    gate_field: str = "hold_headers",
    *,
    model: str = "slow",
    **fields: Any,
) -> tuple[asyncio.Event, asyncio.Task[Resp]]:
    """A call for ``model`` held at the fake by a fresh gate (``Fault(**fields)``, the
    gate in ``gate_field``): (the gate, the task). The call is not waited for."""
    gate = asyncio.Event()
    fields[gate_field] = gate
    fake.script_for_model(model, [Fault(**fields)])
    return gate, asyncio.create_task(call(http, sc, model=model))


async def until_status(
    http: aiohttp.ClientSession,
    sc: Sidecar,
    key: str,
    predicate: Callable[[dict[str, Any]], bool],
    turns: int = 200,
) -> dict[str, Any]:
    """Poll ``/status`` for a bounded number of loop turns until ``predicate(entry)``."""
    last: dict[str, Any] = {}
    for _ in range(turns):
        last = await entry(http, sc, key)
        if predicate(last):
            return last
        await asyncio.sleep(0)
    raise AssertionError(f"/status never satisfied the condition; last entry: {last}")


def rfc3339(text: str) -> float:
    """Unix seconds of an RFC 3339 timestamp; must carry a UTC offset or ``Z``."""
    when = datetime.fromisoformat(text)
    assert when.tzinfo is not None, text
    return when.timestamp()


def assert_at(text: str | None, clock: FakeClock, t: float) -> None:
    """``text`` (RFC 3339, millisecond precision) shows monotonic instant ``t`` of ``clock``."""
    assert text is not None
    off = rfc3339(text) - clock.wall(t)
    assert abs(off) < 0.002, f"{text} is {off:+.3f} s off the expected instant"


async def first_n_done(
    tasks: Sequence[asyncio.Task[Resp]], n: int
) -> tuple[list[Resp], list[asyncio.Task[Resp]]]:
    """Wait (bounded) for ``n`` of ``tasks`` to finish: (their results, the tasks still running)."""
    results: list[Resp] = []
    async with asyncio.timeout(WAIT_S):
        for fut in asyncio.as_completed(tasks):
            results.append(await fut)
            if len(results) == n:
                break
    return results, [t for t in tasks if not t.done()]
