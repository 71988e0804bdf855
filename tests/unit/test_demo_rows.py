"""The demo's table rows show the breaker state of the event lines printed above them."""

from __future__ import annotations

import io
from collections.abc import Callable

import aiohttp
from aiohttp import web

from sidecar.demo.show import Screen, Story, current_status


def story() -> Story:
    return Story(Screen(io.StringIO(), color=False), now=lambda: 1.0)


async def admin(states: list[str], during: Callable[[int], None]) -> web.AppRunner:
    """A /status endpoint answering ``states`` in turn; ``during(n)`` runs after the
    n-th snapshot is taken and before its answer is sent (where a breaker event
    can be logged in the real sidecar)."""
    calls = 0

    async def status(request: web.Request) -> web.Response:
        nonlocal calls
        body = {"breakers": [{"upstream": "primary", "model": "*", "state": states[calls]}]}
        calls += 1
        during(calls)
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def url(runner: web.AppRunner) -> str:
    site = next(iter(runner.sites))
    assert isinstance(site, web.TCPSite)
    return site.name


async def test_a_transition_during_the_fetch_fetches_again() -> None:
    st = story()
    fetched: list[int] = []

    def during(n: int) -> None:
        fetched.append(n)
        if n == 1:  # the probe's success is logged while the old snapshot travels
            st.transition("breaker_closed", {"upstream": "primary"})

    runner = await admin(["half_open", "closed"], during)
    try:
        async with aiohttp.ClientSession() as http:
            status = await current_status(http, url(runner), st)
    finally:
        await runner.cleanup()
    assert status["breakers"][0]["state"] == "closed" == st.state
    assert fetched == [1, 2]


async def test_no_transition_fetches_once() -> None:
    st = story()
    fetched: list[int] = []
    runner = await admin(["open", "closed"], fetched.append)
    try:
        async with aiohttp.ClientSession() as http:
            status = await current_status(http, url(runner), st)
    finally:
        await runner.cleanup()
    assert status["breakers"][0]["state"] == "open"
    assert fetched == [1]
