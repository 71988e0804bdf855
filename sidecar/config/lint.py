"""Warnings about a valid config (pure): what loads fine but is almost surely a mistake.

``sidecar check-config`` prints them on stderr as ``warning: key.path: message`` and
``sidecar serve`` logs each as a ``config_warning`` line at start and on reload; they
never change the exit code. Three kinds:

* an upstream that no route's candidates name (never called; often a typo in a name);
  when an environment override created it (it is not in the file), the warning names
  the variable and the file's nearest upstream name
  (``SIDECAR__UPSTREAMS__PRIMRY__BASE_URL``: did you mean ``primary``?);
* a route no request can reach: the routes tried before it (contract, "Route
  resolution": longest ``path_prefix`` first; at equal prefixes more conditions
  first, ``models`` and ``match_headers`` one each; then file order) already take
  every request it would match. Only a route with the same ``path_prefix`` can do
  that (a longer prefix misses part of the paths, a shorter one is tried later); it
  does when its ``match_headers`` ask for nothing this route does not also require
  (``"*"`` is implied by any value of the same header), and it has no ``models`` or,
  together with the other such routes before it, lists every model this one lists.

* a ``hedge_after_ms`` that can never send a hedge: the route has one candidate (no
  next one to race), or its first candidate's ``first_byte_timeout_ms`` is not longer
  (that candidate times out first and the route simply falls back).

Messages name keys, routes, upstreams and variables, never a value from the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sidecar.config.decode import Err
from sidecar.config.overrides import CreatedTable

if TYPE_CHECKING:
    from sidecar.config import Config, RouteConfig


def config_warnings(config: Config, created: Mapping[str, CreatedTable] | None = None) -> list[Err]:
    """Every warning for ``config``, as (key path, message), upstreams first, then
    routes, each in file order.

    :param created: table path -> the table an environment override created
        (:attr:`sidecar.config.overrides.Overrides.created`), named in the warning about
        an unused upstream the environment made.
    """
    return (
        unused_upstreams(config, created or {})
        + unreachable_routes(config.routes)
        + idle_hedges(config)
    )


def unused_upstreams(config: Config, created: Mapping[str, CreatedTable]) -> list[Err]:
    """``upstreams.<name>: no route uses this upstream`` for each upstream that no
    candidate of any route names."""
    used = {c.upstream for r in config.routes for c in r.candidates}
    out: list[Err] = []
    for name in config.upstreams:
        if name in used:
            continue
        path = f"upstreams.{name}"
        msg = "no route uses this upstream"
        if path in created:
            msg += f", which is {created[path].note()}"
        out.append((path, msg))
    return out


def _conditions(r: RouteConfig) -> int:
    return (r.models is not None) + bool(r.match_headers)


def _implies(later: RouteConfig, earlier: RouteConfig) -> bool:
    """True when every request matching ``later``'s headers matches ``earlier``'s."""
    for name, want in earlier.match_headers.items():
        have = later.match_headers.get(name)
        if have is None or (want != "*" and have != want):
            return False
    return True


def unreachable_routes(routes: tuple[RouteConfig, ...]) -> list[Err]:
    """``routes[i]: no request can reach route ...`` for each route whose every
    request is taken by routes tried before it (the module docstring has the rule)."""
    order = sorted(
        range(len(routes)), key=lambda i: (-len(routes[i].path_prefix), -_conditions(routes[i]))
    )
    out: list[tuple[int, str]] = []
    for k, i in enumerate(order):
        route = routes[i]
        catchers = [
            j
            for j in order[:k]
            if routes[j].path_prefix == route.path_prefix and _implies(route, routes[j])
        ]
        takers = next(([j] for j in catchers if routes[j].models is None), None)
        if takers is None and route.models is not None:
            models = route.models
            takers = [j for j in catchers if models & (routes[j].models or frozenset())]
            listed = frozenset().union(*(routes[j].models or frozenset() for j in takers))
            if not models <= listed:
                takers = None
        if takers:
            names = ", ".join(f"routes[{j}] ({json.dumps(routes[j].name)})" for j in takers)
            verbs = "has" if len(takers) == 1 else "have"
            rest = (
                "is tried before it and takes"
                if len(takers) == 1
                else "are tried before it and take"
            )
            out.append(
                (
                    i,
                    f"no request can reach route {json.dumps(route.name)}: {names} {verbs} "
                    f"the same path_prefix, {rest} every request it matches",
                )
            )
    return [(f"routes[{i}]", msg) for i, msg in sorted(out)]


def idle_hedges(config: Config) -> list[Err]:
    """``routes[i].hedge_after_ms: ...`` for each route whose ``hedge_after_ms`` (> 0)
    can never send a hedge: one candidate only, or the first candidate's
    ``first_byte_timeout_ms`` no longer than it (contract, "Bounding the load that
    failures add": the hedge waits for the candidate that would be tried next)."""
    out: list[Err] = []
    for i, r in enumerate(config.routes):
        after = r.hedge_after_ms
        if after == 0:
            continue
        path = f"routes[{i}].hedge_after_ms"
        if len(r.candidates) < 2:
            out.append((path, "the route has one candidate: there is no next one to hedge to"))
            continue
        first = config.upstreams.get(r.candidates[0].upstream)
        if first is not None and first.first_byte_timeout_ms <= after:
            out.append(
                (
                    path,
                    f"not shorter than the first candidate's first_byte_timeout_ms "
                    f"(upstreams.{r.candidates[0].upstream}): it times out before a "
                    "hedge is due",
                )
            )
    return out
