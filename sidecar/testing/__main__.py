"""Serve a fake upstream by hand: ``python -m sidecar.testing --port 8001 [options]``.

Examples::

    python -m sidecar.testing --port 8001 --fail-first 3 --status 503 --retry-after 2
    curl -s localhost:8001/v1/chat/completions -d '{"model": "gpt-4o"}'
    curl -s localhost:8001/v1/chat/completions -H 'x-fake-fault: {"reset_after_chunks": 2}' \\
        -d '{"model": "gpt-4o", "stream": true}'

To show a fallback through a proxy (which relays the fault header to every upstream
it tries), name the fakes and aim the fault at one of them with ``x-fake-fault-for``::

    python -m sidecar.testing --port 8001 --name primary &
    python -m sidecar.testing --port 8002 --name backup &
    curl -s localhost:8080/v1/chat/completions -H 'x-fake-fault: {"status": 503}' \\
        -H 'x-fake-fault-for: primary' -d '{"model": "gpt-4o"}'   # primary 503s, backup answers

Listens on 127.0.0.1 only; prints ``listening on http://127.0.0.1:PORT`` once
ready (``--port 0`` picks a free port), then one line per request as it arrives
(``--quiet``: none), and stops on SIGINT/SIGTERM::

    #1 POST /v1/chat/completions model=gpt-4o stream=false -> 503 [script: status=503 ...]
    #2 POST /v1/messages model=claude stream=true -> 200 [x-fake-fault: reset_after_chunks=2]
    #3 GET /v1/models model=- stream=false -> 200 [default]

The bracket says where the request's fault came from (the ``x-fake-fault``
header, the ``--fail-first`` script, or the default) and the fields it sets. No
header value or body is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
from collections.abc import Sequence

from .fake_upstream import FAULT_HEADER, FakeUpstream
from .fault import Fault, ReceivedRequest


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
    p.add_argument(
        "--name",
        default=None,
        help="this fake's name: a request with 'x-fake-fault-for: NAME[,NAME...]' gets its "
        "x-fake-fault only on the fakes it names (the others answer as if it were absent)",
    )
    p.add_argument("--quiet", action="store_true", help="no line per request")
    return p.parse_args(argv)


QUIET_FIELDS = frozenset(
    {"body", "text", "headers", "hold_headers", "hold_first_chunk", "hold_after_chunks"}
)
"""Fault fields the request line leaves out (bodies, reply text, header values, gates)."""


def describe(rec: ReceivedRequest, default: Fault, fake: FakeUpstream | None = None) -> str:
    """One log line for ``rec``: index, method, path (no query), model, stream, status,
    and the fault's source and the fields it sets apart from a healthy answer.

    :param fake: the fake that served ``rec``, to tell whether its ``x-fake-fault``
        header applied (``x-fake-fault-for``); None: it did whenever present.
    """
    if fake is not None:
        applied = fake.fault_header_applies(rec.headers)
    else:
        applied = FAULT_HEADER in rec.headers
    source = "default" if rec.fault == default else "script"
    source = FAULT_HEADER if applied else source
    healthy = Fault()
    fields = " ".join(
        f"{f.name}={value!r}"
        for f in dataclasses.fields(Fault)
        if f.name not in QUIET_FIELDS
        and (value := getattr(rec.fault, f.name)) != getattr(healthy, f.name)
    )
    return (
        f"#{rec.index} {rec.method} {rec.path} model={rec.model or '-'} "
        f"stream={str(rec.stream).lower()} -> {rec.fault.status} "
        f"[{source}{': ' + fields if fields else ''}]"
    )


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

    fake = FakeUpstream(port=args.port, default=default, name=args.name)

    def log(rec: ReceivedRequest) -> None:
        print(describe(rec, default, fake), flush=True)

    fake.on_request = None if args.quiet else log
    async with fake:
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
