"""The admin port's ``POST /breakers/{upstream}/{model}``: an operator's override.

Contract, "The admin port". Only when ``server.admin_token_env`` names a set, non-empty
variable (read at start and on each reload: :attr:`sidecar.generation.Runtime.admin_token`);
otherwise every method on these paths answers 404 as a path that does not exist. Then:

- no ``Authorization: Bearer <token>``, or a wrong one: 401 (JSON error, and
  ``WWW-Authenticate: Bearer``, RFC 6750 section 3), compared in constant time; the
  header's value is never logged (one ``admin_unauthorized`` warning line says only
  that one was missing or wrong, with the path);
- a method other than POST: 405; a body that is not a valid override: 400 with what is
  wrong (:func:`sidecar.override_request.parse_body`);
- a target that has no breaker in the current config: 404 ``unknown_target``;
- else the override is applied (:meth:`sidecar.breakers.port.BreakerPort.set_override`)
  and the answer is 200 with the target's ``/status`` entry, ``override`` included.

``{model}`` is the candidate's model, ``*`` (``%2A``) for a candidate without one; a
model with ``/`` in it (``meta-llama/Llama-3.1-8B``) is taken as the rest of the path.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from sidecar import logs
from sidecar.breakers.machine import Target
from sidecar.generation import Runtime
from sidecar.override_request import BadRequest, authorized, parse_body

ROUTE = "/breakers/{upstream}/{model:.+}"


def _error(status: int, code: str, message: str) -> web.Response:
    body = {"error": {"message": message, "type": code, "code": code}}
    return web.json_response(body, status=status)


def make_handler(rt: Runtime) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of :data:`ROUTE` (every method), reading ``rt`` at each request."""

    async def override(request: web.Request) -> web.StreamResponse:
        token = rt.admin_token
        if token is None:
            raise web.HTTPNotFound()  # the same answer as a path that does not exist
        if not authorized(request.headers.get("Authorization"), token):
            why = "missing" if "Authorization" not in request.headers else "wrong"
            logs.event("admin_unauthorized", level=logging.WARNING, path=request.path, token=why)
            resp = _error(401, "unauthorized", "a valid Authorization: Bearer token is required")
            resp.headers["WWW-Authenticate"] = 'Bearer realm="sidecar-admin"'
            return resp
        if request.method != "POST":
            raise web.HTTPMethodNotAllowed(request.method, ["POST"])
        try:
            doc = json.loads(await request.read())
        except (ValueError, RecursionError):  # RecursionError: nested past the decoder
            return _error(400, "bad_request", "the body must be JSON")
        try:
            req = parse_body(doc)
        except BadRequest as exc:
            return _error(400, "bad_request", str(exc))
        target = Target(request.match_info["upstream"], request.match_info["model"])
        breakers = rt.current.breakers
        if not breakers.set_override(target, req.action, req.reason, req.for_ms):
            return _error(
                404,
                "unknown_target",
                f"no breaker for {target.upstream}/{target.model} in the current config "
                "(targets are (upstream, candidate model or *) whose upstream has a "
                "circuit_breaker)",
            )
        entry = next(
            e
            for e in breakers.status(True)
            if (e["upstream"], e["model"]) == target and "credential" not in e
        )
        return web.json_response(entry)

    return override
