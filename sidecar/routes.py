"""The compiled route table (pure): which route serves a request.

Rule (contract, "The proxy port"): the routes whose ``path_prefix`` matches the
path and whose ``models`` (when set) contains the body's ``model``; of those the
longest prefix wins; at equal prefixes a route with ``models`` beats one
without; then file order. A body that is not JSON, or has no ``model``, matches
only routes without ``models``.
"""

from __future__ import annotations

from typing import NamedTuple

from sidecar.body import body_model
from sidecar.breaker import Target
from sidecar.config import Config


class Candidate(NamedTuple):
    """One ordered choice of a route: an upstream, and the model to rewrite to (or None)."""

    upstream: str
    model: str | None
    target: Target


class Route(NamedTuple):
    """A compiled route: name, prefix, optional model set, ordered candidates."""

    name: str
    path_prefix: str
    models: frozenset[str] | None
    candidates: tuple[Candidate, ...]


class RouteTable:
    """Routes ordered for resolution; built once per config."""

    def __init__(self, config: Config) -> None:
        routes = [
            Route(
                r.name,
                r.path_prefix,
                r.models,
                tuple(
                    Candidate(c.upstream, c.model, Target(c.upstream, c.model or "*"))
                    for c in r.candidates
                ),
            )
            for r in config.routes
        ]
        # Longest prefix first; at equal prefixes routes with `models` first; then
        # file order (sorted() is stable).
        self.routes: tuple[Route, ...] = tuple(
            sorted(routes, key=lambda r: (-len(r.path_prefix), r.models is None))
        )

    def needs_model(self, path: str) -> bool:
        """True when resolving ``path`` depends on the body's ``model``."""
        return any(r.models is not None and path.startswith(r.path_prefix) for r in self.routes)

    def resolve(self, path: str, body: bytes) -> Route | None:
        """Return the route for ``path``, parsing ``body`` only if a candidate route needs it.

        :param path: the request path (no query string).
        :param body: the request body; its JSON ``model`` string (None when the body
            is not JSON or has none) is read at most once, and only for a route
            with ``models``.
        :returns: the winning :class:`Route`, or None when no route matches.
        """
        have_model = False
        value: str | None = None
        for route in self.routes:
            if not path.startswith(route.path_prefix):
                continue
            if route.models is None:
                return route
            if not have_model:
                value, have_model = body_model(body), True
            if value is not None and value in route.models:
                return route
        return None
