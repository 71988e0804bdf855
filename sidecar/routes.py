"""The compiled route table (pure): which route serves a request.

Rule (contract, "The proxy port", "Route resolution"): the routes whose
``path_prefix`` matches the path, whose ``match_headers`` (when set) all match
the request's headers (names in any letter case; ``"*"`` = the header is
present; any other value = equal to it exactly), and whose ``models`` (when
set) contains the body's ``model``; of those the longest prefix wins; at equal
prefixes a route with more conditions (``models`` and ``match_headers`` count
one each) beats one with fewer; then file order. A body that is not JSON, or
has no ``model``, matches only routes without ``models``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from sidecar.body import body_model
from sidecar.breakers.machine import Target
from sidecar.config import Balance, CandidateConfig, Config, RouteConfig
from sidecar.target_stats import TargetStats

ANY_VALUE = "*"
"""A ``match_headers`` value that matches any value of a header that is present."""


class Candidate(NamedTuple):
    """One choice of a route: an upstream, and the model to rewrite to (or None)."""

    upstream: str
    model: str | None
    target: Target
    weight: float = 1.0
    """Its ``weight`` among the members of its tier (routes with tiers only)."""
    stats: TargetStats | None = None
    """Its target's statistics (calls in flight, time to first output), which the
    chooser reads and the request path updates: bound for a member of a route with
    tiers (the same object for every such member of one target), None otherwise (a
    plain route's calls are not counted)."""


class Route(NamedTuple):
    """A compiled route: name, prefix, optional model set, header conditions, candidates.

    ``match_headers``: (lower-cased name, ``"*"`` or exact value) pairs; empty = none.
    """

    name: str
    path_prefix: str
    models: frozenset[str] | None
    match_headers: tuple[tuple[str, str], ...]
    candidates: tuple[Candidate, ...]
    context_window_fallback: bool = True
    """``routes[].context_window_fallback``: a context-window 400/413 moves on."""
    tiers: tuple[tuple[Candidate, ...], ...] | None = None
    """The candidates grouped by ``tier``, ascending (each group in file order); None
    for a route whose candidates set no tier: an ordered list, tried one by one."""
    balance: Balance = "least_loaded"
    """How a member of a tier is chosen (:func:`sidecar.choice.choose`)."""
    affinity_header: str | None = None
    """``affinity_header``, lower-cased: a session's requests keep to one member
    (:mod:`sidecar.affinity`); None: no sessions."""
    affinity_ttl_s: float = 3600.0
    """``affinity_ttl_ms`` in seconds."""
    first_tier: frozenset[Target] = frozenset()
    """The targets of the first tier's members (the ones that hold sessions)."""
    hedge_after_s: float = 0.0
    """``hedge_after_ms`` in seconds: > 0, a candidate with no output this long after
    it was sent is raced by the next one (:mod:`sidecar.hedge`); 0 = off."""

    @property
    def conditions(self) -> int:
        """How many conditions beyond the prefix: ``models`` and ``match_headers`` one each."""
        return (self.models is not None) + bool(self.match_headers)

    def headers_match(self, headers: Mapping[str, str]) -> bool:
        """True when every ``match_headers`` entry matches ``headers``.

        :param headers: the request headers, a case-insensitive mapping (aiohttp's
            ``CIMultiDictProxy``); a repeated header is matched on its first value.
        """
        for name, want in self.match_headers:
            value = headers.get(name)
            if value is None or (want != ANY_VALUE and value != want):
                return False
        return True


def _candidate(c: CandidateConfig, stats: Mapping[Target, TargetStats] | None = None) -> Candidate:
    """A candidate's compiled form: its target is (upstream, model or ``*``); with
    ``stats`` (a member of a route with tiers), its target's statistics bound."""
    target = Target(c.upstream, c.model or "*")
    bound = stats.get(target) if stats is not None else None
    return Candidate(c.upstream, c.model, target, c.weight or 1.0, bound)


def _tiers(
    route: RouteConfig, stats: Mapping[Target, TargetStats]
) -> tuple[tuple[Candidate, ...], ...] | None:
    """``route``'s candidates grouped by tier, ascending, each bound to its target's
    entry of ``stats`` (None where it has none); None when no candidate sets a tier."""
    if all(c.tier is None for c in route.candidates):
        return None
    groups: dict[int, list[Candidate]] = {}
    for c in route.candidates:
        groups.setdefault(c.tier or 0, []).append(_candidate(c, stats))
    return tuple(tuple(groups[t]) for t in sorted(groups))


class RouteTable:
    """Routes ordered for resolution; built once per config."""

    def __init__(self, config: Config, stats: Mapping[Target, TargetStats] | None = None) -> None:
        """:param stats: per-target statistics to bind to the members of routes with
        tiers (:attr:`Candidate.stats`); a target absent gets none."""
        stats = stats or {}
        routes = [
            Route(
                r.name,
                r.path_prefix,
                r.models,
                tuple(r.match_headers.items()),
                tuple(_candidate(c) for c in r.candidates),
                r.context_window_fallback,
                tiers := _tiers(r, stats),
                r.balance,
                r.affinity_header,
                r.affinity_ttl_ms / 1000,
                frozenset(c.target for c in tiers[0]) if tiers else frozenset(),
                r.hedge_after_ms / 1000,
            )
            for r in config.routes
        ]
        # Longest prefix first; at equal prefixes more conditions first; then file
        # order (sorted() is stable).
        self.routes: tuple[Route, ...] = tuple(
            sorted(routes, key=lambda r: (-len(r.path_prefix), -r.conditions))
        )

    def needs_model(self, path: str, headers: Mapping[str, str]) -> bool:
        """True when some route at ``path`` whose headers match depends on the body's ``model``.

        Used when nothing matched: then a body without a string ``model`` is the
        caller's mistake (400 ``bad_request``), not a missing route (404).
        """
        return any(
            r.models is not None and path.startswith(r.path_prefix) and r.headers_match(headers)
            for r in self.routes
        )

    def resolve_readings(
        self, paths: Iterable[str], headers: Mapping[str, str], body: bytes
    ) -> tuple[bool, Route | None]:
        """The route of a path with dot segments, given every way an upstream may read it
        (:func:`sidecar.target.path_readings`): (True, the route all of them pick, maybe
        None), or (False, None) when they differ (a ``path_prefix`` confines what the
        upstream serves with that route's key, and the upstream resolves the target it
        gets as it will: RFC 3986 section 5.2.4)."""
        chosen = {id(r): r for r in (self.resolve(p, headers, body) for p in paths)}
        if len(chosen) != 1:
            return False, None
        return True, chosen.popitem()[1]

    def resolve(self, path: str, headers: Mapping[str, str], body: bytes) -> Route | None:
        """Return the route for the request, parsing ``body`` only if a candidate route needs it.

        :param path: the request path (no query string).
        :param headers: the request headers, case-insensitive (see :meth:`Route.headers_match`).
        :param body: the request body; its JSON ``model`` string (None when the body
            is not JSON or has none, :func:`~sidecar.body.body_model`) is read at most
            once, and only for a route with ``models``.
        :returns: the winning :class:`Route`, or None when no route matches.
        """
        have_model = False
        value: str | None = None
        for route in self.routes:
            if not path.startswith(route.path_prefix):
                continue
            if route.match_headers and not route.headers_match(headers):
                continue
            if route.models is None:
                return route
            if not have_model:
                value, have_model = body_model(body), True
            if value is not None and value in route.models:
                return route
        return None
