"""Route resolution and the candidate ``model`` rewrite, through the running sidecar.

Every route sends to its own upstream name (all on the same fake), so
``x-sidecar-upstream`` tells which route won. Also: 404 ``no_route`` (no route
for the path or the model) and 400 ``bad_request`` when model routing needs a
JSON body with a string ``model`` and gets none.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from sidecar.testing import FakeUpstream, Fault
from tests.configs import config, route, route_table, upstream
from tests.conftest import StartSidecar

Route = tuple[str, str, list[str] | None]  # (name; its upstream is "up_" + name), prefix, models


TABLE: list[Route] = [
    ("root", "/", None),
    ("v1", "/v1/", None),
    ("v1_again", "/v1/", None),  # same prefix, no models, later in the file: never wins
    ("v1_smart", "/v1/", ["smart", "fast"]),  # models beat no models at equal prefix
    ("v1_smart_again", "/v1/", ["smart"]),  # later in the file than v1_smart
    ("chat", "/v1/chat/", None),  # longer prefix beats models
    ("chat_mini", "/v1/chat/completions", ["mini"]),
]


@pytest.mark.parametrize(
    ("path", "body", "winner"),
    [
        ("/v1/chat/completions", {"model": "smart"}, "chat"),
        ("/v1/chat/completions", {"model": "mini"}, "chat_mini"),
        ("/v1/chat/other", {"model": "mini"}, "chat"),
        ("/v1/embeddings", {"model": "smart"}, "v1_smart"),
        ("/v1/embeddings", {"model": "fast"}, "v1_smart"),
        ("/v1/embeddings", {"model": "other"}, "v1"),
        ("/v1/embeddings", {"no_model": True}, "v1"),
        ("/v1/embeddings", {"model": 7}, "v1"),
        ("/v1/embeddings", ["smart"], "v1"),
        ("/v1/embeddings", b"model=smart", "v1"),
        ("/v1/embeddings", b"", "v1"),
        ("/v1", {"model": "smart"}, "root"),
        ("/health", {"model": "smart"}, "root"),
    ],
)
async def test_route_resolution(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    path: str,
    body: Any,
    winner: str,
) -> None:
    sc = await start_sidecar(route_table(fake.url, TABLE))
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(sc.proxy_url + path, data=data) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == f"up_{winner}"
        await r.read()
    assert fake.request_count == 1
    assert fake.requests[0].path == path
    assert fake.requests[0].body == data


async def test_models_route_wins_at_equal_prefix_whatever_the_file_order(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    table: list[Route] = [("plain", "/v1/", None), ("picky", "/v1/", ["m"])]
    for order in (table, table[::-1]):
        sc = await start_sidecar(route_table(fake.url, order))
        async with http.post(sc.proxy_url + "/v1/x", json={"model": "m"}) as r:
            assert r.headers["x-sidecar-upstream"] == "up_picky"
        async with http.post(sc.proxy_url + "/v1/x", json={"model": "n"}) as r:
            assert r.headers["x-sidecar-upstream"] == "up_plain"


async def test_file_order_breaks_ties(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for first, second in (("one", "two"), ("two", "one")):
        table: list[Route] = [(first, "/v1/", ["m"]), (second, "/v1/", ["m"])]
        sc = await start_sidecar(route_table(fake.url, table))
        async with http.post(sc.proxy_url + "/v1/x", json={"model": "m"}) as r:
            assert r.headers["x-sidecar-upstream"] == f"up_{first}"


async def test_no_matching_prefix_is_404_no_route(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(route_table(fake.url, [("v1", "/v1/", None)]))
    async with http.post(sc.proxy_url + "/v2/chat/completions", json={"model": "m"}) as r:
        assert r.status == 404
        assert r.headers["x-sidecar-error"] == "no_route"
        assert r.headers["x-sidecar-attempts"] == "0"
        assert r.headers["Content-Type"].startswith("application/json")
        doc = await r.json()
    assert doc["error"]["code"] == "no_route"
    assert doc["error"]["type"] == "no_route"
    assert isinstance(doc["error"]["message"], str)
    assert fake.request_count == 0


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"messages": []}', b'["m"]', b"", b'{"model": 1}'],
    ids=["not_json", "no_model", "array", "empty", "model_not_a_string"],
)
async def test_model_routing_without_a_match_is_400_bad_request(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    body: bytes,
) -> None:
    sc = await start_sidecar(route_table(fake.url, [("only_m", "/v1/", ["m"])]))
    async with http.post(sc.proxy_url + "/v1/chat/completions", data=body) as r:
        assert r.status == 400
        assert r.headers["x-sidecar-error"] == "bad_request"
        assert r.headers["x-sidecar-attempts"] == "0"
        doc = await r.json()
    assert doc["error"]["code"] == "bad_request"
    assert fake.request_count == 0
    async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.status == 200  # control: the route itself works
    async with http.post(sc.proxy_url + "/elsewhere", json={"model": "m"}) as r:
        assert r.status == 404  # outside every prefix: no route, not a bad request
        assert r.headers["x-sidecar-error"] == "no_route"


@pytest.mark.parametrize("model", ["other", "M", ""])
async def test_a_json_model_no_route_lists_is_404_no_route(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession, model: str
) -> None:
    # Contract: the body is fine (JSON, a string model); no route serves that model.
    table: list[Route] = [("only_m", "/v1/", ["m"]), ("other_path", "/v2/", None)]
    sc = await start_sidecar(route_table(fake.url, table))
    async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": model}) as r:
        assert r.status == 404
        assert r.headers["x-sidecar-error"] == "no_route"
        assert r.headers["x-sidecar-attempts"] == "0"
        doc = await r.json()
    assert doc["error"]["code"] == "no_route"
    assert fake.request_count == 0


# -- the candidate model rewrite ----------------------------------------------------

ORIGINAL = (
    b'{ "messages" : [ {"role": "user", "content": "h\\u00e9llo \xe2\x98\x83 \\"q\\"\\n"} ],\n'
    b'  "model": "smart",  "temperature": 0.7, "top_p": 1.0, "n": 1, "tiny": 1e-7,\n'
    b'  "seed": 18446744073709551615, "big": 123456789012345678901234567890,\n'
    b'  "nested": {"a": [null, true, false, -0, 2.5e+3], "model": "inner-stays"},\n'
    b'  "stream": false, "empty": {}, "tools": [] }'
)


def two_candidate_config(a: str, b: str) -> str:
    """Route ``chat`` (model ``smart``): ``primary`` at ``a`` as ``gpt-4o-mini``, ``backup``."""
    return config(
        upstreams={"primary": upstream(a, retry={"max_retries": 0}), "backup": upstream(b)},
        routes=[
            route(
                "chat",
                {"upstream": "primary", "model": "gpt-4o-mini"},
                "backup",
                path_prefix="/v1/",
                models=["smart"],
            )
        ],
    )


async def test_candidate_model_rewrites_only_the_model(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(two_candidate_config(fake.url, fake2.url))
    async with http.post(sc.proxy_url + "/v1/chat/completions", data=ORIGINAL) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "primary"
        assert (await r.json())["model"] == "gpt-4o-mini"
    sent = fake.requests[0]
    assert sent.model == "gpt-4o-mini"
    want = json.loads(ORIGINAL)
    want["model"] = "gpt-4o-mini"
    assert sent.json() == want
    assert int(sent.headers["Content-Length"]) == len(sent.body)


async def test_candidate_without_model_gets_the_original_bytes(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """After a rewriting candidate fails, the next one (no ``model``) gets the exact bytes."""
    fake.set_default(Fault(status=503))
    sc = await start_sidecar(two_candidate_config(fake.url, fake2.url))
    async with http.post(sc.proxy_url + "/v1/chat/completions", data=ORIGINAL) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "backup"
        assert r.headers["x-sidecar-attempts"] == "2"
    assert fake.requests[0].model == "gpt-4o-mini"
    assert fake2.requests[0].body == ORIGINAL


async def test_rewrite_is_the_same_on_every_retry(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    fake.script([Fault(status=503), Fault(status=503)])
    sc = await start_sidecar(
        config(
            upstreams={
                "primary": upstream(fake.url, retry={"max_retries": 2, "backoff_initial_ms": 1})
            },
            routes=[route("chat", {"upstream": "primary", "model": "rewritten"})],
        )
    )
    async with http.post(sc.proxy_url + "/v1/chat/completions", data=ORIGINAL) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-attempts"] == "3"
    assert fake.request_count == 3
    assert len({rec.body for rec in fake.requests}) == 1
    assert fake.requests[2].json()["model"] == "rewritten"


def rewriting(url: str) -> str:
    """Route ``any`` (every path): its one candidate ``primary`` as model ``rewritten``."""
    return config(
        upstreams={"primary": upstream(url)},
        routes=[route("any", {"upstream": "primary", "model": "rewritten"})],
    )


async def test_rewriting_candidate_leaves_a_non_json_body_alone(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(rewriting(fake.url))
    for body in (b"plain text, not json", b'["model", "x"]', b'{"model": "x"'):
        async with http.post(sc.proxy_url + "/echo/x", data=body) as r:
            assert r.status == 200
    assert [rec.body for rec in fake.requests] == [
        b"plain text, not json",
        b'["model", "x"]',
        b'{"model": "x"',
    ]


async def test_rewrite_adds_a_model_when_the_body_has_none(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(rewriting(fake.url))
    async with http.post(sc.proxy_url + "/v1/embeddings", json={"input": ["a", "b"]}) as r:
        assert r.status == 200
    assert fake.requests[0].json() == {"input": ["a", "b"], "model": "rewritten"}
