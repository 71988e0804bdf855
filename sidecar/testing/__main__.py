"""Serve a fake upstream by hand: ``python -m sidecar.testing --port 8001 [options]``.

Examples::

    python -m sidecar.testing --port 8001 --fail-first 3 --status 503 --retry-after 2
    curl -s localhost:8001/v1/chat/completions -d '{"model": "gpt-4o"}'
    curl -s localhost:8001/v1/chat/completions -H 'x-fake-fault: {"reset_after_chunks": 2}' \\
        -d '{"model": "gpt-4o", "stream": true}'

Listens on 127.0.0.1 only; prints ``listening on http://127.0.0.1:PORT`` once
ready (``--port 0`` picks a free port); stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

from .fake_upstream import FakeUpstream
from .fault import Fault


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m sidecar.testing", description=__doc__.split("\n")[0]
    )
    p.add_argument("--port", type=int, default=8001, help="port on 127.0.0.1 (0: any free one)")
    p.add_argument(
        "--fail-first", type=int, default=0, metavar="N", help="fail the first N requests"
    )
    p.add_argument("--status", type=int, default=503, help="status of the failing requests")
    p.add_argument("--retry-after", default=None, help="Retry-After value of the failing requests")
    p.add_argument("--chunks", type=int, default=5, help="SSE content chunks per streamed reply")
    p.add_argument("--chunk-delay-ms", type=float, default=0, help="gap between body chunks (ms)")
    p.add_argument(
        "--delay-first-chunk-ms",
        type=float,
        default=0,
        help="wait before the first body chunk (ms)",
    )
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[list[Fault], Fault]:
    """The (script, default) faults the command line asks for."""
    default = Fault(
        chunks=args.chunks,
        chunk_delay_ms=args.chunk_delay_ms,
        delay_first_chunk_ms=args.delay_first_chunk_ms,
    )
    failing = Fault(status=args.status, retry_after=args.retry_after)
    return [failing] * args.fail_first, default


async def serve(args: argparse.Namespace) -> None:
    """Run the fake upstream until SIGINT/SIGTERM."""
    script, default = build(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with FakeUpstream(port=args.port, default=default) as fake:
        fake.script(script)
        print(f"listening on {fake.url}", flush=True)
        await stop.wait()
        print(f"stopping after {fake.request_count} requests", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    asyncio.run(serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
