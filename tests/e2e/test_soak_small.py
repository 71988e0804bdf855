"""The soak in small, in-process: 2,100 mixed requests, and nothing grows with the count.

The same traffic mix as ``benchmarks/soak.py`` (successes, streams, upstream 503s,
resets before the answer and mid-stream, clients leaving mid-stream and before
the answer, a breaker that opens and closes, 413s, 400s), driven against the
in-process sidecar and fake upstream. After a warm-up round (the baseline) and
after each further round, with the client session closed and the fake idle:

* asyncio tasks, minus one per open upstream connection (the fake's handler
  task for it), equal the baseline;
* open fds, minus two per open upstream connection (its two ends, both in this
  process), do not exceed the baseline;
* the sidecar has no client connection left, and its upstream connections stay
  within the pool bound (two upstream names x the driver's concurrency);
* every request ended in an outcome its kind allows.
"""

from __future__ import annotations

import asyncio
import collections
import os

from benchmarks.soak import KINDS, config_toml, drive, unexpected
from sidecar.clock import LoopClock
from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream
from tests.conftest import StartSidecar

CONCURRENCY = 16
WARM_UP = len(KINDS) * 15
ROUND = len(KINDS) * 40
ROUNDS = 3


async def checkpoint(sc: Sidecar, fake: FakeUpstream) -> dict[str, int]:
    """Wait until no client connection is open and the fake runs no handler; measure."""
    assert sc.connections is not None
    async with asyncio.timeout(10):
        await fake.wait_until(lambda: fake.active_requests == 0)
    for _ in range(5000):  # loop turns (IO is polled on each) until the closes are seen
        if not sc.connections.open_connections:
            break
        await asyncio.sleep(0)
    assert not sc.connections.open_connections, "client connections still open in the sidecar"
    for _ in range(20):  # a few more turns for callbacks scheduled by the closes
        await asyncio.sleep(0)
    upstream = fake.open_connections
    return {
        "tasks": len(asyncio.all_tasks()) - upstream,
        "fds": len(os.listdir("/proc/self/fd")) - 2 * upstream,
        "upstream": upstream,
    }


async def test_mixed_traffic_leaves_no_growth(
    fake: FakeUpstream, start_sidecar: StartSidecar
) -> None:
    sc = await start_sidecar(config_toml(fake.url), clock_=LoopClock())
    counts: collections.Counter[str] = collections.Counter()
    counts += await drive(sc.proxy_url, range(WARM_UP), CONCURRENCY)
    base = await checkpoint(sc, fake)
    seen = [base]
    for r in range(ROUNDS):
        start = WARM_UP + r * ROUND
        counts += await drive(sc.proxy_url, range(start, start + ROUND), CONCURRENCY)
        seen.append(await checkpoint(sc, fake))

    assert not unexpected(counts), counts
    assert sum(counts.values()) == WARM_UP + ROUNDS * ROUND
    for point in seen[1:]:
        assert point["tasks"] == base["tasks"], seen
        assert point["fds"] <= base["fds"], seen
        assert point["upstream"] <= 2 * CONCURRENCY, seen
    # The mix did exercise the failure paths.
    for key in ("stream_cut:cut", "reset:502", "upstream_503:503", "too_large:413"):
        assert counts[key] > 0, counts
