"""The embedded default config with both official SDKs: every call reaches its own provider.

Contract ("Command line", config lookup): with no config file, ``/v1/messages``
and every ``/v1/`` call carrying ``anthropic-version`` go to ``anthropic``, every
other ``/v1/`` call to ``openai``, and the client's own credentials pass through.
So a client's Anthropic key never reaches OpenAI, nor the other way round.

Two fake providers stand in for the real ones; the default config's base URLs are
overridden from the environment, as an operator would do
(``SIDECAR__UPSTREAMS__OPENAI__BASE_URL``...). The SDKs talk to the real sidecar.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio

from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream, ReceivedRequest
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar

OPENAI_KEY = "sk-proj-openai-client-key-canary"
ANTHROPIC_KEY = "sk-ant-api03-anthropic-client-key-canary"
HELLO = "Hello from the fake upstream"
MESSAGES: Any = [{"role": "user", "content": "hi"}]
DEFAULT = importlib.resources.files("sidecar").joinpath("default.toml").read_text("utf-8")


class Providers:
    def __init__(self, openai_fake: FakeUpstream, anthropic_fake: FakeUpstream) -> None:
        self.openai = openai_fake
        self.anthropic = anthropic_fake


@pytest_asyncio.fixture
async def providers() -> AsyncIterator[Providers]:
    async with FakeUpstream() as o, FakeUpstream() as a:
        yield Providers(o, a)


@pytest_asyncio.fixture
async def default_sidecar(providers: Providers, start_sidecar: StartSidecar) -> Sidecar:
    env = {
        "SIDECAR__UPSTREAMS__OPENAI__BASE_URL": providers.openai.url,
        "SIDECAR__UPSTREAMS__ANTHROPIC__BASE_URL": providers.anthropic.url,
    }
    return await start_sidecar(DEFAULT, environ=env)


def header_values(rec: ReceivedRequest) -> str:
    return "\n".join(f"{k}: {v}" for k, v in rec.headers.items())


def assert_no_cross_credentials(p: Providers) -> None:
    """No request to one provider carried the other provider's key, in any header."""
    for rec in p.openai.requests:
        assert ANTHROPIC_KEY not in header_values(rec), rec.path
        assert "anthropic-version" not in rec.headers and "x-api-key" not in rec.headers
    for rec in p.anthropic.requests:
        assert OPENAI_KEY not in header_values(rec), rec.path
        assert "anthropic-version" in rec.headers


def anthropic_client(sc: Sidecar, auth: str) -> anthropic.AsyncAnthropic:
    """This SDK version sends its key as ``Authorization: Bearer``; older ones (and
    Anthropic's curl examples) as ``x-api-key``: both are tried."""
    if auth == "bearer":
        return anthropic.AsyncAnthropic(base_url=sc.proxy_url, api_key=ANTHROPIC_KEY, max_retries=0)
    return anthropic.AsyncAnthropic(
        base_url=sc.proxy_url,
        api_key=None,
        default_headers={"x-api-key": ANTHROPIC_KEY},
        max_retries=0,
    )


@pytest.mark.parametrize("auth", ["bearer", "x-api-key"])
async def test_both_sdks_reach_their_own_provider_only(
    providers: Providers, default_sidecar: Sidecar, auth: str
) -> None:
    sc = default_sidecar
    oa = openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key=OPENAI_KEY, max_retries=0)
    an = anthropic_client(sc, auth)
    try:
        # OpenAI SDK: models.list, chat (JSON and streamed), embeddings.
        assert "gpt-4o" in [m.id async for m in oa.models.list()]
        done = await oa.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        assert done.choices[0].message.content == HELLO
        stream = await oa.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == (
            HELLO
        )
        emb = await oa.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
        assert len(emb.data) == 2
        # Anthropic SDK: models.list (GET /v1/models, as OpenAI's), messages (JSON and streamed).
        page = await an.models.list()
        assert "claude-sonnet-4-5" in [m.id for m in page.data]
        msg = await an.messages.create(model="claude-fake-1", max_tokens=5, messages=MESSAGES)
        assert msg.content[0].type == "text" and msg.content[0].text == HELLO
        async with an.messages.stream(
            model="claude-fake-1", max_tokens=5, messages=MESSAGES
        ) as events:
            assert await events.get_final_text() == HELLO
    finally:
        await oa.close()
        await an.close()

    openai_paths = [(r.method, r.path) for r in providers.openai.requests]
    anthropic_paths = [(r.method, r.path) for r in providers.anthropic.requests]
    assert openai_paths == [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/embeddings"),
    ]
    assert anthropic_paths == [
        ("GET", "/v1/models"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages"),
    ]
    assert_no_cross_credentials(providers)
    for rec in providers.openai.requests:  # each client's own key passed through
        assert rec.headers.getall("Authorization") == [f"Bearer {OPENAI_KEY}"]
    for rec in providers.anthropic.requests:
        assert ANTHROPIC_KEY in header_values(rec)


async def test_raw_anthropic_style_calls_never_reach_openai(
    providers: Providers, default_sidecar: Sidecar, http: aiohttp.ClientSession
) -> None:
    """Without the SDK: any /v1/ path with ``anthropic-version`` goes to Anthropic, in any
    letter case; without it, to OpenAI."""
    sc = default_sidecar
    cases = [
        ("GET", "/v1/models", {"x-api-key": ANTHROPIC_KEY, "anthropic-version": "2023-06-01"}),
        ("GET", "/v1/models/claude-x", {"X-Api-Key": ANTHROPIC_KEY, "Anthropic-Version": "1"}),
        ("POST", "/v1/messages/count_tokens", {"x-api-key": ANTHROPIC_KEY}),
        ("POST", "/v1/messages", {"x-api-key": ANTHROPIC_KEY}),
        ("GET", "/v1/models", {"Authorization": f"Bearer {OPENAI_KEY}"}),
    ]
    for method, path, headers in cases:
        async with http.request(method, sc.proxy_url + path, headers=headers, json={}) as r:
            assert r.status == 200, path
            await r.read()
    assert [r.path for r in providers.anthropic.requests] == [
        "/v1/models",
        "/v1/models/claude-x",
        "/v1/messages/count_tokens",
        "/v1/messages",
    ]
    assert [r.path for r in providers.openai.requests] == ["/v1/models"]
    for rec in providers.openai.requests:
        assert ANTHROPIC_KEY not in header_values(rec)
    for rec in providers.anthropic.requests:
        assert OPENAI_KEY not in header_values(rec)


async def test_a_model_no_route_serves_is_the_sdks_not_found_error(
    fake: FakeUpstream, start_sidecar: StartSidecar
) -> None:
    """Contract: a JSON body whose ``model`` no route lists is 404 ``no_route``: the
    SDK raises NotFoundError (not BadRequestError), and nothing is sent upstream."""
    sc = await start_sidecar(
        config(
            upstreams={"only": upstream(fake.url)},
            routes=[route("chat", "only", path_prefix="/v1/", models=["gpt-4o"])],
        )
    )
    oa = openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key="k", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError) as exc:
            await oa.chat.completions.create(model="gpt-5-unlisted", messages=MESSAGES)
        assert exc.value.status_code == 404
        assert exc.value.response.headers["x-sidecar-error"] == "no_route"
        ok = await oa.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        assert ok.choices[0].message.content == HELLO
    finally:
        await oa.close()
    assert fake.request_count == 1
