"""The bare relay baseline: the least an aiohttp reverse proxy can do.

Read the body, forward it with one shared ClientSession, stream the response
back chunk by chunk. No routing, retries, breaker or metrics: the floor that
the sidecar's extra work is measured against. Runs on uvloop when it is
installed, as ``sidecar serve`` does, so the two differ only in their own work.

    python benchmarks/bare_relay.py --port 8081 --upstream http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web

HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding"}
HOP_UP = HOP | {"upgrade", "host", "content-length"}
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def handle(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_UP}
    url = request.app[UPSTREAM] + request.raw_path
    async with request.app[SESSION].request(
        request.method, url, headers=headers, data=body, allow_redirects=False
    ) as up:
        resp = web.StreamResponse(
            status=up.status,
            reason=up.reason,
            headers={k: v for k, v in up.headers.items() if k.lower() not in HOP},
        )
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def app_factory(upstream: str, max_connections: int) -> web.Application:
    app = web.Application(client_max_size=2**30)
    app[UPSTREAM] = upstream.rstrip("/")

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections),
            auto_decompress=False,
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed (the sidecar's choice), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--max-connections", type=int, default=1024)
    a = p.parse_args()
    web.run_app(
        app_factory(a.upstream, a.max_connections),
        host="127.0.0.1",
        port=a.port,
        access_log=None,
        print=None,
        loop=new_loop(),
    )
