"""A no-op OTLP/HTTP trace receiver for the benchmarks: it reads each export and answers
200 with an empty ``ExportTraceServiceResponse`` (an empty protobuf message is zero
bytes), counting what it got, and decodes nothing (its CPU is not the sidecar's).

    python benchmarks/otlp_sink.py --port 4318

Used by ``benchmarks/overhead.py --tracing RATIO`` (the sidecar's ``otlp_endpoint``).
"""

from __future__ import annotations

import argparse

from aiohttp import web

EXPORTS = web.AppKey("exports", list)


async def traces(request: web.Request) -> web.Response:
    body = await request.read()
    request.app[EXPORTS].append(len(body))
    return web.Response(body=b"", content_type="application/x-protobuf")


async def stats(request: web.Request) -> web.Response:
    sizes = request.app[EXPORTS]
    return web.json_response({"exports": len(sizes), "bytes": sum(sizes)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=4318)
    args = p.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[EXPORTS] = []
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/stats", stats)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
