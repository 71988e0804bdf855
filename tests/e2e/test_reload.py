"""Live config reload: ConfigMap symlink swap, invalid config, reload during a stream."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.config import load_config
from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.configs import config, route, upstream
from tests.conftest import metric, status


def config_text(
    primary: str,
    backup: str,
    *,
    backup_breaker: dict[str, Any] | None = None,
    cooldown_ms: int = 60000,
    candidates: tuple[str, ...] = ("rl_primary", "rl_backup"),
) -> str:
    """``rl_primary`` (no retries, threshold-1 breaker of ``cooldown_ms``), ``rl_backup``
    (breaker table ``backup_breaker``, empty by default), route ``chat`` over
    ``candidates``; both listeners on port 0."""
    return config(
        server={"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
        upstreams={
            "rl_primary": upstream(
                primary,
                retry={"max_retries": 0},
                circuit_breaker={"failure_threshold": 1, "cooldown_ms": cooldown_ms},
            ),
            "rl_backup": upstream(backup, circuit_breaker=backup_breaker or {}),
        },
        routes=[route("chat", *candidates, path_prefix="/v1/")],
    )


class ConfigMapDir:
    """A directory laid out like a Kubernetes ConfigMap volume (``..data`` symlink swap)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0
        (root / "sidecar.toml").symlink_to("..data/sidecar.toml")

    @property
    def path(self) -> str:
        return str(self.root / "sidecar.toml")

    def publish(self, text: str) -> None:
        """Write a new timestamped dir and atomically swap ``..data`` to it, as kubelet does."""
        self.n += 1
        version = self.root / f"..2026_11_30_{self.n}"
        version.mkdir()
        (version / "sidecar.toml").write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(version.name)
        os.replace(tmp, self.root / "..data")


async def start(cm: ConfigMapDir, clock: FakeClock) -> Sidecar:
    config = load_config(cm.path, {})
    sc = Sidecar(config, environ={}, clock=clock, config_path=cm.path, watch_interval_s=0.02)
    await sc.start()
    return sc


async def wait_reload(sc: Sidecar) -> None:
    assert sc.watcher is not None
    async with asyncio.timeout(5):
        await sc.watcher.changed.wait()
    sc.watcher.changed.clear()


async def test_symlink_swap_keeps_open_breaker_and_live_stream(
    tmp_path: Path,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    cm = ConfigMapDir(tmp_path)
    cm.publish(config_text(fake.url, fake2.url))
    sc = await start(cm, clock)
    try:
        # Open the primary's breaker.
        fake.set_default(Fault(status=503))
        async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
            assert r.status == 200
            assert r.headers["x-sidecar-upstream"] == "rl_backup"
        assert (await status(http, sc))["rl_primary/*"]["state"] == "open"

        # A stream in flight on the backup, held after its first output event.
        gate = asyncio.Event()
        fake2.set_default(Fault(hold_after_chunks=(2, gate)))
        resp = await http.post(
            sc.proxy_url + "/v1/chat/completions", json={"model": "m", "stream": True}
        )
        assert resp.status == 200
        first = await resp.content.readany()
        assert first.startswith(b"data: ")

        # Swap the ConfigMap: the backup's breaker settings change, a route is added.
        cm.publish(config_text(fake.url, fake2.url, backup_breaker={"failure_threshold": 7}))
        await wait_reload(sc)

        after = await status(http, sc)
        assert after["rl_primary/*"]["state"] == "open"  # same settings: state kept
        assert after["rl_backup/*"]["state"] == "closed"
        assert await metric(http, sc, "sidecar_config_reloads_total", result="success") >= 1

        # The stream started before the reload completes intact.
        gate.set()
        rest = await resp.read()
        assert (first + rest).endswith(b"data: [DONE]\n\n")
        resp.release()

        # New requests still skip the open primary (no connection made to it).
        accepted = fake.connections_accepted
        fake2.set_default(Fault())
        async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
            assert r.headers["x-sidecar-upstream"] == "rl_backup"
        assert fake.connections_accepted == accepted
    finally:
        await sc.stop()


async def test_invalid_config_is_refused_and_old_keeps_serving(
    tmp_path: Path,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cm = ConfigMapDir(tmp_path)
    cm.publish(config_text(fake.url, fake2.url))
    sc = await start(cm, clock)
    try:
        errors_before = await metric(http, sc, "sidecar_config_reloads_total", result="error")
        bad = config_text(fake.url, fake2.url, cooldown_ms=0)
        with caplog.at_level(logging.INFO, logger="sidecar"):
            cm.publish(bad)
            await wait_reload(sc)
        failed = [r for r in caplog.records if r.getMessage() == "config_reload_failed"]
        assert failed
        fields = getattr(failed[0], "fields")  # noqa: B009
        assert any(
            e.startswith("upstreams.rl_primary.circuit_breaker.cooldown_ms:")
            for e in fields["errors"]
        )
        assert (
            await metric(http, sc, "sidecar_config_reloads_total", result="error")
            == errors_before + 1
        )
        async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
            assert r.status == 200
            assert r.headers["x-sidecar-upstream"] == "rl_primary"
    finally:
        await sc.stop()


async def test_removed_target_leaves_status_and_metrics(
    tmp_path: Path,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    cm = ConfigMapDir(tmp_path)
    cm.publish(config_text(fake.url, fake2.url))
    sc = await start(cm, clock)
    try:
        assert "rl_backup/*" in await status(http, sc)
        labels = {"upstream": "rl_backup", "model": "*", "state": "closed"}
        assert await metric(http, sc, "sidecar_breaker_state", **labels) == 1.0
        only_primary = config_text(fake.url, fake2.url, candidates=("rl_primary",))
        cm.publish(only_primary)
        await wait_reload(sc)
        assert "rl_backup/*" not in await status(http, sc)
        async with http.get(sc.admin_url + "/metrics") as r:
            text = await r.text()
        assert 'upstream="rl_backup"' not in "\n".join(
            line for line in text.splitlines() if line.startswith("sidecar_breaker_state")
        )
    finally:
        await sc.stop()


async def test_a_reload_during_a_half_open_probe_lets_no_second_probe_through(
    tmp_path: Path,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """Contract, "Reload": an accepted reload keeps an unchanged breaker exactly as it is,
    a half-open probe in flight with its slot. Before, a SIGHUP that changed an unrelated
    route freed the slot and the next request reached the still-sick upstream."""
    cm = ConfigMapDir(tmp_path)
    cm.publish(config_text(fake.url, fake2.url, cooldown_ms=1000))
    sc = await start(cm, clock)
    try:
        fake.set_default(Fault(status=503))
        async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
            assert r.headers["x-sidecar-upstream"] == "rl_backup"  # opened the primary's
        clock.advance(1.0)
        assert (await status(http, sc))["rl_primary/*"]["state"] == "half_open"

        # The probe reaches the primary and is held there.
        gate = asyncio.Event()
        fake.set_default(Fault(hold_headers=gate))
        probe = asyncio.ensure_future(
            http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"})
        )
        await fake.wait_for_requests(2)

        # A reload that changes only an unrelated route.
        text = config_text(fake.url, fake2.url, cooldown_ms=1000)
        cm.publish(text + '\n[[routes]]\nname = "other"\npath_prefix = "/other/"\n'
                   'candidates = [{ upstream = "rl_backup" }]\n')  # fmt: skip
        await wait_reload(sc)
        entry = (await status(http, sc))["rl_primary/*"]
        assert (entry["state"], entry["probes_in_flight"]) == ("half_open", 1)

        # Another request: the probe slot is taken, so the primary is skipped.
        async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
            assert r.headers["x-sidecar-upstream"] == "rl_backup"
        assert fake.request_count == 2

        # The probe succeeds: it settles on the kept breaker, which closes.
        fake.set_default(Fault())
        gate.set()
        async with await probe as r:
            assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "rl_primary")
        entry = (await status(http, sc))["rl_primary/*"]
        assert (entry["state"], entry["probes_in_flight"]) == ("closed", 0)
        async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
            assert r.headers["x-sidecar-upstream"] == "rl_primary"
    finally:
        await sc.stop()


async def test_a_reload_keeps_an_unchanged_breakers_failure_rate_window(
    tmp_path: Path,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """Contract, "Reload": an unchanged breaker is kept exactly as it is, its failure-rate
    window too; a breaker whose settings changed starts again, with an empty window."""

    def text(minimum_calls: int, extra_route: bool) -> str:
        cb = {"failure_threshold": 100, "failure_rate_threshold": 0.5,
              "minimum_calls": minimum_calls, "cooldown_ms": 10_000}  # fmt: skip
        body = config(
            server={"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
            upstreams={
                "rl_primary": upstream(fake.url, retry={"max_retries": 0}, circuit_breaker=cb),
                "rl_backup": upstream(fake2.url),
            },
            routes=[route("chat", "rl_primary", "rl_backup", path_prefix="/v1/")],
        )
        other = '\n[[routes]]\nname = "other"\npath_prefix = "/o/"\ncandidates = ["rl_backup"]\n'
        return body + (other.replace('["rl_backup"]', '[{ upstream = "rl_backup" }]')
                       if extra_route else "")  # fmt: skip

    async def one(fails: bool) -> str:
        fake.script([Fault(status=503)] if fails else [])
        async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
            return r.headers["x-sidecar-upstream"]

    cm = ConfigMapDir(tmp_path)
    cm.publish(text(4, False))
    sc = await start(cm, clock)
    try:
        for fails in (True, False, False):  # 3 calls in the window: 1 failed
            await one(fails)
        cm.publish(text(4, True))  # an unrelated route added: the window is kept
        await wait_reload(sc)
        await one(True)  # 2 of 4 failed: open
        assert (await status(http, sc))["rl_primary/*"]["state"] == "open"

        # The cooldown (under client_read_timeout_ms, which would close the idle client
        # connection); the probe closes it, and the window starts empty.
        clock.advance(11.0)
        assert await one(False) == "rl_primary"
        for fails in (True, False, False):
            await one(fails)
        cm.publish(text(3, True))  # this breaker's settings change: a new, empty window
        await wait_reload(sc)
        await one(True)  # 1 of 1 in the new window: under minimum_calls
        assert (await status(http, sc))["rl_primary/*"]["state"] == "closed"
    finally:
        await sc.stop()


async def test_an_accepted_reload_logs_the_new_configs_warnings(
    tmp_path: Path,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 23 item 6: a reload that drops the backup from every route still goes
    through, and says that no route uses it any more (a ``config_warning`` line)."""
    cm = ConfigMapDir(tmp_path)
    cm.publish(config_text(fake.url, fake2.url))
    sc = await start(cm, clock)
    try:
        before = await metric(http, sc, "sidecar_config_reloads_total", result="success")
        with caplog.at_level(logging.INFO, logger="sidecar"):
            cm.publish(config_text(fake.url, fake2.url, candidates=("rl_primary",)))
            await wait_reload(sc)
        warned = [
            getattr(r, "fields")  # noqa: B009
            for r in caplog.records
            if r.getMessage() == "config_warning"
        ]
        assert warned == [{"key": "upstreams.rl_backup", "detail": "no route uses this upstream"}]
        assert [r.levelno for r in caplog.records if r.getMessage() == "config_warning"] == [
            logging.WARNING
        ]
        reloads = await metric(http, sc, "sidecar_config_reloads_total", result="success")
        assert reloads == before + 1
    finally:
        await sc.stop()
