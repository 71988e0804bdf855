"""``sidecar demo``: a self-contained show of the circuit breaker, on loopback only.

Everything runs in this process on ``127.0.0.1`` (port 0 everywhere): two fake
providers (:class:`sidecar.testing.FakeUpstream`), ``primary`` and
``fallback``; the real :class:`~sidecar.server.Sidecar` in front of them with
a breaker on ``primary``; and a traffic driver playing the app. In the middle of
the run the primary answers 503, then hangs, then recovers. Every second a
table row shows the breaker state (read from the admin port's
``GET /status?all=1``), who served the requests and what they cost; event
lines (``>>``) show the breaker's transitions as the sidecar logs them.

For the comparison in the summary, a *twin* sidecar with the same config but
no breaker, in front of its own pair of fakes with the same faults, gets the
same traffic at the same moments: its numbers are measured, not estimated.

The sidecar's JSON logs never reach the screen: the ``sidecar`` logger is
pointed at a handler that only reads the breaker events (see
:class:`~sidecar.demo.show.BreakerLogTap`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack

import aiohttp

from sidecar.config import parse_config
from sidecar.demo.report import Phase, Report, intro, scrape, table_header, table_row
from sidecar.demo.script import (
    FALLBACK_OK,
    LOOPBACK,
    PRIMARY_OK,
    SETTINGS,
    demo_config,
    phases,
)
from sidecar.demo.show import BreakerLogTap, Screen, Story, current_status
from sidecar.demo.traffic import Driver
from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream

__all__ = ["run_demo"]

MIN_SECONDS, MAX_SECONDS = 8.0, 55.0
RATE = 8.0  # requests per second
EXIT_OK, EXIT_FAILURE, EXIT_INTERRUPTED = 0, 1, 130


@contextlib.contextmanager
def tap_sidecar_logs(story: Story) -> Iterator[None]:
    """Send the ``sidecar`` logger to ``story`` only (nothing on the screen)."""
    logger = logging.getLogger("sidecar")
    saved = logger.level, logger.propagate, list(logger.handlers)
    logger.handlers[:] = [BreakerLogTap(story)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        logger.handlers[:] = saved[2]


def run_demo(seconds: float) -> int:
    """Run the demo with about ``seconds`` of traffic; returns the exit code.

    ``seconds`` is kept within 8..55 (the story needs 8; the whole show must end
    in under 60 s). Ctrl-C (or SIGTERM) stops the traffic, prints the summary so
    far and returns 130; a second Ctrl-C stops at once.
    """
    screen = Screen()
    wanted = seconds
    seconds = min(max(seconds, MIN_SECONDS), MAX_SECONDS)
    if seconds != wanted:
        screen.line(
            f"(--seconds {wanted:g} is outside {MIN_SECONDS:g}..{MAX_SECONDS:g}: "
            f"running {seconds:g} s)"
        )
    try:
        return asyncio.run(_demo(seconds, screen))
    except (KeyboardInterrupt, asyncio.CancelledError):
        screen.line("interrupted")
        return EXIT_INTERRUPTED
    except OSError as exc:
        print(f"sidecar demo: cannot start: {exc}", file=sys.stderr)
        return EXIT_FAILURE


async def _demo(seconds: float, screen: Screen) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()

    def on_signal() -> None:
        if stop.is_set() and main_task is not None:
            main_task.cancel()  # second Ctrl-C: stop now
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    t0 = loop.time()

    def now() -> float:
        return loop.time() - t0

    story = Story(screen, now)
    with tap_sidecar_logs(story):
        async with AsyncExitStack() as stack:
            fakes = {
                name: await stack.enter_async_context(
                    FakeUpstream(default=PRIMARY_OK if "primary" in name else FALLBACK_OK)
                )
                for name in ("primary", "fallback", "twin_primary", "twin_fallback")
            }
            sidecars: dict[str, Sidecar] = {}
            for name, prefix, breaker in (("main", "", True), ("twin", "twin_", False)):
                text = demo_config(
                    fakes[prefix + "primary"].url, fakes[prefix + "fallback"].url, breaker=breaker
                )
                sc = Sidecar(
                    parse_config(text, {}, "<demo>"),
                    environ={},
                    proxy_listen=LOOPBACK,
                    admin_listen=LOOPBACK,
                )
                sidecars[name] = await stack.enter_async_context(sc)
            session = await stack.enter_async_context(
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))
            )
            script = phases(seconds)
            report = Report(screen, story, seconds, script, SETTINGS)
            before = await scrape(session, sidecars["main"].admin_url)
            for line in intro(screen, fakes, sidecars["main"], script, seconds, RATE, SETTINGS):
                screen.line(line)
            t0 = loop.time()
            driver = Driver(
                session,
                {name: sc.proxy_url for name, sc in sidecars.items()},
                RATE,
                now,
            )
            tasks = [
                asyncio.create_task(driver.run(seconds, stop)),
                asyncio.create_task(_play(script, fakes, report, now, stop)),
                asyncio.create_task(_watch(fakes["primary"], story)),
                asyncio.create_task(
                    _tick(session, sidecars["main"], fakes, driver, report, now, seconds, stop)
                ),
            ]
            try:
                await tasks[0]
                report.stopped_at = now()
                await tasks[3]  # the last row
                await driver.drain(grace=3.0)
            finally:
                for task in tasks[1:]:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            report.counts_at_end(fakes)
            after = await scrape(session, sidecars["main"].admin_url)
            for line in report.summary(driver.results, before, after, interrupted=stop.is_set()):
                screen.line(line)
    return EXIT_INTERRUPTED if stop.is_set() and not screen.closed else EXIT_OK


async def _play(
    script: list[Phase],
    fakes: dict[str, FakeUpstream],
    report: Report,
    now: Callable[[], float],
    stop: asyncio.Event,
) -> None:
    """Switch both primaries' behaviour at each phase time."""
    for phase in script:
        delay = phase.at - now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            return
        for name in ("primary", "twin_primary"):
            fakes[name].set_default(phase.fault)
            fakes[name].release()  # stalled responses of the previous phase go on
        report.phase_started(phase, fakes)


async def _watch(fake: FakeUpstream, story: Story) -> None:
    """Tell ``story`` about every request reaching the primary (to spot the probes)."""
    seen = fake.request_count

    def more() -> bool:
        return fake.request_count > seen

    while True:
        await fake.wait_until(more)
        seen = fake.request_count
        story.primary_request()


async def _tick(
    session: aiohttp.ClientSession,
    sidecar: Sidecar,
    fakes: dict[str, FakeUpstream],
    driver: Driver,
    report: Report,
    now: Callable[[], float],
    seconds: float,
    stop: asyncio.Event,
) -> None:
    """One table row per second of traffic."""
    for line in table_header(report.screen):
        report.screen.line(line)
    calls = {name: fakes[name].request_count for name in ("primary", "twin_primary")}
    k = 1
    while k <= seconds + 0.5 and not stop.is_set():
        delay = k - now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                return
        status = await current_status(session, sidecar.admin_url, report.story)
        counts = {name: fakes[name].request_count for name in calls}
        row = table_row(
            report.screen,
            k,
            [r for r in driver.results["main"] if k - 1 <= r.ended < k],
            status,
            counts["primary"] - calls["primary"],
            counts["twin_primary"] - calls["twin_primary"],
        )
        report.screen.line(row)
        if report.screen.closed:  # stdout went away (`sidecar demo | head`): stop early
            stop.set()
        calls = counts
        k += 1
