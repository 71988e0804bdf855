#!/usr/bin/env python3
"""The PromQL of a Grafana dashboard, as a Prometheus rule file, for ``promtool check rules``.

    python3 deploy/tools/dashboard_exprs.py deploy/grafana/sidecar-dashboard.json > rules.json
    promtool check rules rules.json

Every panel target's ``expr`` (rows' nested panels included) and every query
variable's ``label_values(selector, label)`` selector becomes one recording rule,
with Grafana's variables replaced by values Prometheus accepts (``$__rate_interval``
-> ``1m``, any other ``$var`` or ``${var}`` -> ``.*``, used inside label matchers).
promtool then parses each expression: a syntax error in a panel fails CI instead
of showing "bad_data" on the dashboard. The output is JSON, which is YAML too.
Standard library only.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from typing import Any

DURATION_VARS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
VAR_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
LABEL_VALUES_RE = re.compile(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$", re.S)


def substitute(expr: str) -> str:
    """``expr`` with Grafana's variables replaced (see the module docstring)."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return DURATION_VARS.get(name, ".*")

    return VAR_RE.sub(repl, expr)


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable."""
    for p in panels(dashboard.get("panels", [])):
        for t in p.get("targets", []):
            if t.get("expr"):
                yield f"panel {p.get('id')} {p.get('title')!r} target {t.get('refId')}", t["expr"]
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        query = q.get("query", "") if isinstance(q, dict) else str(q or "")
        m = LABEL_VALUES_RE.match(query)
        yield f"variable {v.get('name')!r}", m.group(1) if m else query


def rule_file(dashboard: dict[str, Any]) -> dict[str, Any]:
    """A rule group with one recording rule per expression."""
    rules = []
    for i, (where, expr) in enumerate(exprs(dashboard)):
        rules.append(
            {"record": f"dashboard:expr_{i}", "expr": substitute(expr), "labels": {"at": where}}
        )
    return {"groups": [{"name": "dashboard", "rules": rules}]}


def main(argv: list[str]) -> int:
    """Entry point: print the rule file of the dashboard at ``argv[0]``."""
    if len(argv) != 1:
        print(__doc__.strip().split("\n")[0], file=sys.stderr)
        print("usage: dashboard_exprs.py DASHBOARD.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        dashboard = json.load(f)
    out = rule_file(dashboard)
    if not out["groups"][0]["rules"]:
        print("dashboard_exprs: no expressions found", file=sys.stderr)
        return 1
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
