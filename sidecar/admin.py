"""The admin port: ``/metrics``, ``/healthz``, ``/readyz``, ``/status``, and the operator's
``POST /breakers/{upstream}/{model}`` (:mod:`sidecar.admin_breakers`).

Contract, "The admin port".
"""

from __future__ import annotations

from aiohttp import web
from prometheus_async.aio.web import server_stats

from sidecar.admin_breakers import ROUTE as BREAKERS_ROUTE
from sidecar.admin_breakers import make_handler as breakers_handler
from sidecar.generation import Runtime

RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
"""The admin app's runtime (typed app key)."""


async def healthz(request: web.Request) -> web.Response:
    """200 while the process serves."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """200 when config is loaded and the proxy listens; 503 while draining or not yet listening."""
    rt = request.app[RUNTIME]
    if rt.draining or not rt.listening:
        return web.json_response({"status": "draining" if rt.draining else "starting"}, status=503)
    return web.json_response({"status": "ready"})


async def status(request: web.Request) -> web.Response:
    """``{"breakers": [...]}``: open and half-open targets; ``?all=1`` lists every target."""
    rt = request.app[RUNTIME]
    all_targets = request.query.get("all", "") not in ("", "0", "false")
    return web.json_response({"breakers": rt.current.breakers.status(all_targets)})


def create_admin_app(runtime: Runtime) -> web.Application:
    """The admin :class:`aiohttp.web.Application` reading ``runtime``."""
    app = web.Application()
    app[RUNTIME] = runtime
    app.router.add_get("/metrics", server_stats)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_route("*", BREAKERS_ROUTE, breakers_handler(runtime))
    return app
