"""What an operator sees of config reloads: the counter's series and the reload log line.

A real ``sidecar serve`` child (a fresh process, so the counter starts at 0), its
``/metrics`` and its JSON log; reloads are asked for with SIGHUP.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.configs import config, route, upstream
from tests.serve_proc import ServeProc, child_env


def surfaces_config(
    cooldown_ms: int = 30000, threshold: int = 3, more_routes: tuple[dict[str, Any], ...] = ()
) -> str:
    """``alpha`` (breaker ``threshold`` / ``cooldown_ms``) and ``beta`` (breaker on
    defaults) under route ``chat``, then ``more_routes`` as given."""
    # The upstreams are never called: only the config's shape matters here.
    return config(
        server={"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
        upstreams={
            "alpha": upstream(
                "http://127.0.0.1:9",
                circuit_breaker={"failure_threshold": threshold, "cooldown_ms": cooldown_ms},
            ),
            "beta": upstream("http://127.0.0.1:9", circuit_breaker={}),
        },
        routes=[
            route(
                "chat", {"upstream": "alpha", "model": "m1"}, "alpha", "beta", path_prefix="/v1/"
            ),
            *more_routes,
        ],
    )


async def reloads(admin_url: str) -> dict[str, float]:
    """``sidecar_config_reloads_total`` by ``result``, from a scrape of ``/metrics``."""
    async with aiohttp.ClientSession() as http, http.get(f"{admin_url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "sidecar_config_reloads":
            for s in fam.samples:
                if s.name == "sidecar_config_reloads_total":
                    out[s.labels["result"]] = s.value
    return out


async def test_reload_counter_series_from_start_up_and_the_reset_breakers_named(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text(surfaces_config())
    async with await ServeProc.start(path, child_env()) as sc:
        # Before any reload: every result has its series, at 0.
        assert await reloads(sc.admin_url) == {"success": 0, "unchanged": 0, "error": 0}

        # alpha's breaker settings change (both its targets); beta's do not.
        path.write_text(surfaces_config(cooldown_ms=5000))
        sc.signal(signal.SIGHUP)
        line = await sc.wait_for_event("config_reloaded")
        assert line["breakers_reset"] == [
            {"upstream": "alpha", "model": "*"},
            {"upstream": "alpha", "model": "m1"},
        ]
        assert line["targets_kept"] == 1
        assert await reloads(sc.admin_url) == {"success": 1, "unchanged": 0, "error": 0}

        path.write_text(surfaces_config(threshold=0))
        sc.signal(signal.SIGHUP)
        failed = await sc.wait_for_event("config_reload_failed")
        assert any("failure_threshold" in e for e in failed["errors"])
        assert await reloads(sc.admin_url) == {"success": 1, "unchanged": 0, "error": 1}


async def test_reload_without_breaker_changes_resets_none(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text(surfaces_config())
    async with await ServeProc.start(path, child_env()) as sc:
        # A new route: a config change, but no breaker's settings change.
        path.write_text(surfaces_config(more_routes=(route("other", "beta", path_prefix="/v2/"),)))
        sc.signal(signal.SIGHUP)
        line = await sc.wait_for_event("config_reloaded")
        assert line["breakers_reset"] == []
        assert line["targets_kept"] == 3
