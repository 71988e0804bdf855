"""A real aiohttp upstream for one handler, on 127.0.0.1 port 0 (the stream-pump tests' fakes)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web


async def serve_post(
    path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> tuple[web.AppRunner, str]:
    """Serve ``handler`` for ``POST path``; returns the runner (to clean up) and the base URL."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
