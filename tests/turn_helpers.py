"""Helpers of the whole-turn end-to-end tests (tests/e2e/test_turn_*.py).

The fake upstream answers with the byte-exact turn shapes of
:mod:`sidecar.testing.turn_shapes` (reasoning streams, empty turns, usage with cached
tokens); the sidecar runs in process in front of it. What is here:

- which API path and request body a shape answers (:func:`path_of`, :func:`doc_of`);
- the bytes the fake sent for one of its requests, rendered again from its own record
  (:func:`sent_by`), so that what the client got is compared byte for byte;
- the sidecar's config for these tests (:func:`chain_config`): a route over a primary
  upstream (breaker, retries on the FakeClock) and an optional backup;
- ``/metrics`` parsed (:class:`Metrics`, :func:`scrape`) and compared as deltas: the
  Prometheus registry is process-global, one across every test;
- one bounded POST (:func:`post`).

Every wait here is bounded (a failure, never a pace); nothing sleeps on the wall clock.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream, turn_shapes
from sidecar.testing.render import render
from tests import configs
from tests.breaker_e2e_helpers import SERVER_TABLE, breaker_table, chain_upstream

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
WAIT_S = 5.0
"""Bound on any wait (a failure, never a pace)."""

PATHS = {"openai": CHAT, "openrouter": CHAT, "anthropic": MESSAGES, "responses": RESPONSES}
"""The API path of each shape family (the first word of a shape's name)."""

EXPECTED = turn_shapes.EXPECTED_TOKENS
KINDS = ("input", "output", "cache_read", "cache_write")
TOKENS = "sidecar_tokens_total"
ATTEMPTS = "sidecar_upstream_attempts_total"
FALLBACKS = "sidecar_fallbacks_total"
RETRIES = "sidecar_retries_total"
ABORTS = "sidecar_stream_aborts_total"

_names = itertools.count(1)


def unique(prefix: str) -> str:
    """A config name no other test in this process uses (``[a-z][a-z0-9_]*``): metric
    series of its own in the process-global registry."""
    return f"{prefix}{next(_names)}"


def provider(shape: str) -> str:
    """``openai``, ``openrouter``, ``anthropic`` or ``responses``."""
    return shape.split("_", 1)[0]


def path_of(shape: str) -> str:
    return PATHS[provider(shape)]


def streamed(shape: str) -> bool:
    return shape.endswith("_stream")


def doc_of(shape: str, *, model: str = "m", include_usage: bool = True) -> dict[str, Any]:
    """The request body a client sends for ``shape``'s API: ``stream`` as the shape is,
    and ``stream_options.include_usage`` on a chat stream when ``include_usage``."""
    doc: dict[str, Any] = {"model": model, "stream": streamed(shape)}
    if provider(shape) == "responses":
        doc["input"] = "hi"
    else:
        doc["messages"] = [{"role": "user", "content": "hi"}]
    if provider(shape) == "anthropic":
        doc["max_tokens"] = 1024
    if include_usage and streamed(shape) and path_of(shape) == CHAT:
        doc["stream_options"] = {"include_usage": True}
    return doc


def healthy(shape: str) -> str:
    """A shape with output for the same API and framing (the backup's answer)."""
    family = "openai" if provider(shape) == "openrouter" else provider(shape)
    return f"{family}_cached_{'stream' if streamed(shape) else 'json'}"


def chunks_sent(fake: FakeUpstream, index: int = -1) -> list[bytes]:
    """The body writes the fake made for its request ``index`` (rendered again)."""
    rec = fake.requests[index]
    return render(rec, json.loads(rec.body), fake.models).chunks


def sent_by(fake: FakeUpstream, index: int = -1) -> bytes:
    """The whole body the fake sent for its request ``index``."""
    return b"".join(chunks_sent(fake, index))


def chain_config(
    primary_url: str,
    backup_url: str | None = None,
    *,
    retries: int = 0,
    cb: Mapping[str, Any] | None = None,
    names: tuple[str, str] = ("primary", "backup"),
    route: str = "chat",
    **primary_keys: Any,
) -> str:
    """Route ``route`` on ``/v1/`` over ``names[0]`` (``retries`` retries with a 1 ms
    backoff on the FakeClock, breaker ``cb``: threshold 3 unless given, ``primary_keys``)
    then ``names[1]`` (no retry, no breaker) when ``backup_url`` is given."""
    breaker = breaker_table(threshold=3) if cb is None else cb
    upstreams = {
        names[0]: chain_upstream(primary_url, breaker=breaker, retries=retries, **primary_keys)
    }
    if backup_url is not None:
        upstreams[names[1]] = chain_upstream(backup_url, breaker=None)
    return configs.config(
        server=SERVER_TABLE,
        upstreams=upstreams,
        routes=[configs.route(route, *upstreams, path_prefix="/v1/")],
    )


class Answer:
    """A response read to its end."""

    def __init__(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def upstream(self) -> str:
        return self.headers["x-sidecar-upstream"]


async def post(
    http: aiohttp.ClientSession, sc: Sidecar, path: str, doc: Mapping[str, Any]
) -> Answer:
    """POST ``doc`` to the proxy and read the whole answer (bounded)."""
    async with asyncio.timeout(WAIT_S), http.post(sc.proxy_url + path, json=doc) as r:
        return Answer(r.status, CIMultiDict(r.headers), await r.read())


class Metrics:
    """One ``/metrics`` body, parsed: (name, labels, value) per sample."""

    def __init__(self, text: str) -> None:
        self.samples: list[tuple[str, dict[str, str], float]] = [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples ``name`` whose labels include ``labels`` (0.0 when none)."""
        return sum(
            v
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == want for k, want in labels.items())
        )

    def labelsets(self, name: str, **labels: str) -> list[dict[str, str]]:
        """The label sets of the samples ``name`` whose labels include ``labels``."""
        return [
            lab
            for n, lab, _ in self.samples
            if n == name and all(lab.get(k) == want for k, want in labels.items())
        ]

    def tokens(self, **labels: str) -> dict[str, float]:
        """``sidecar_tokens_total`` by ``kind`` over the series matching ``labels``
        (only the kinds that have a series)."""
        out: dict[str, float] = {}
        for n, lab, v in self.samples:
            if n == TOKENS and all(lab.get(k) == want for k, want in labels.items()):
                out[lab["kind"]] = out.get(lab["kind"], 0.0) + v
        return out


async def settle(sc: Sidecar, turns: int = 1000) -> None:
    """Wait (a bounded number of loop turns) until no request is in flight in ``sc``: its
    metrics are recorded in the same ``finally`` that lowers the in-flight count."""
    rt = sc.runtime
    assert rt is not None
    for _ in range(turns):
        if rt.inflight == 0:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{rt.inflight} request(s) still in flight")


async def scrape(http: aiohttp.ClientSession, sc: Sidecar) -> Metrics:
    """``/metrics`` once every request in flight has ended."""
    await settle(sc)
    async with asyncio.timeout(WAIT_S), http.get(sc.admin_url + "/metrics") as r:
        assert r.status == 200
        return Metrics(await r.text())


class Delta:
    """``after - before`` of any sample sum."""

    def __init__(self, before: Metrics, after: Metrics) -> None:
        self.before = before
        self.after = after

    def __call__(self, name: str, **labels: str) -> float:
        return self.after.value(name, **labels) - self.before.value(name, **labels)


async def delta_since(http: aiohttp.ClientSession, sc: Sidecar, before: Metrics) -> Delta:
    return Delta(before, await scrape(http, sc))
