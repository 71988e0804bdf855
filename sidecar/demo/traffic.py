"""The demo's traffic driver: an app sending LLM calls through a sidecar at a steady rate.

Requests are sent open-loop (one every ``1 / rate`` seconds, whatever the
answers take), cycling through four kinds: streamed chat completions (SSE),
JSON chat completions, streamed again, and embeddings. Each answer is read to
its end and checked the way an app would (a stream must end with
``data: [DONE]``, a JSON body must parse); the result is recorded with the
``x-sidecar-upstream`` and ``x-sidecar-attempts`` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

__all__ = ["KINDS", "Driver", "Kind", "Result", "percentile"]


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of request the app sends."""

    path: str
    body: bytes
    stream: bool


def _chat(stream: bool) -> bytes:
    doc = {
        "model": "gpt-4o",
        "stream": stream,
        "messages": [{"role": "user", "content": "Say hello."}],
    }
    return orjson.dumps(doc)


KINDS: tuple[Kind, ...] = (
    Kind("/v1/chat/completions", _chat(True), True),
    Kind("/v1/chat/completions", _chat(False), False),
    Kind("/v1/chat/completions", _chat(True), True),
    Kind(
        "/v1/embeddings",
        orjson.dumps({"model": "text-embedding-3-small", "input": "hello"}),
        False,
    ),
)


@dataclass(frozen=True, slots=True)
class Result:
    """One request as the app saw it; times are seconds since the traffic started."""

    started: float
    ended: float
    stream: bool
    ok: bool
    status: int
    upstream: str
    """``x-sidecar-upstream``, or ``""`` when the sidecar answered itself."""
    attempts: int
    """``x-sidecar-attempts``: upstream attempts made for this request."""

    @property
    def latency_ms(self) -> float:
        return (self.ended - self.started) * 1000


def _complete(kind: Kind, status: int, body: bytes) -> bool:
    """Whether the app got a full, usable answer."""
    if status != 200:
        return False
    if kind.stream:
        return body.rstrip().endswith(b"data: [DONE]")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and ("choices" in doc or "data" in doc)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


class Driver:
    """Sends the same request sequence to every target (name -> proxy URL) at ``rate``/s.

    ``results[name]`` collects the answers. :meth:`run` returns when the traffic
    window ends or ``stop`` is set; :meth:`drain` then waits for the requests
    still in flight.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        targets: dict[str, str],
        rate: float,
        now: Callable[[], float],
    ) -> None:
        self.session = session
        self.targets = targets
        self.interval = 1.0 / rate
        self.now = now
        self.results: dict[str, list[Result]] = {name: [] for name in targets}
        self.sent = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, until: float, stop: asyncio.Event) -> None:
        """Send requests until ``now() >= until`` or ``stop`` is set."""
        n = 0
        while not stop.is_set():
            due = n * self.interval
            if due >= until:
                return
            delay = due - self.now()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                continue
            kind = KINDS[n % len(KINDS)]
            for name, url in self.targets.items():
                task = asyncio.create_task(self._one(name, url, kind))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            n += 1
            self.sent = n

    async def drain(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for requests in flight, then cancel the rest."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    async def _one(self, name: str, url: str, kind: Kind) -> None:
        started = self.now()
        status, upstream, attempts, body = 0, "", 0, b""
        try:
            async with self.session.post(
                url + kind.path,
                data=kind.body,
                headers={"content-type": "application/json", "authorization": "Bearer demo"},
            ) as resp:
                status = resp.status
                upstream = resp.headers.get("x-sidecar-upstream", "")
                attempts = int(resp.headers.get("x-sidecar-attempts", "0") or 0)
                body = await resp.read()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            status = status or 0
            body = b""
        self.results[name].append(
            Result(
                started=started,
                ended=self.now(),
                stream=kind.stream,
                ok=_complete(kind, status, body),
                status=status,
                upstream=upstream,
                attempts=attempts,
            )
        )
