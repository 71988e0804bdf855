"""CPU cost of finding a stream's commit point (``sidecar.sse_hold``), in-process.

    .venv/bin/python benchmarks/sse_hold.py

Each stream head is fed one event per chunk, as providers write them, until the
scanner decides; timed in a tight loop (best of 5 rounds). The baseline in the
same run is ``orjson.loads`` of the same events' JSON: the least any proxy that
judges events by their content must spend. After the decision the relay writes
the held bytes once and pumps the rest without calling the scanner, so a
committed stream costs nothing more per chunk (by construction, not measured).
The last row is the worst case the 64 KiB limit allows: 32,768 two-byte comment
lines, one chunk.

Writes ``results/sse_hold.md`` and ``results/sse_hold.json``.
"""

from __future__ import annotations

import contextlib

import benchlib as bl
import orjson
from micro import per_call

from sidecar.sse_hold import HOLD, SseHold
from sidecar.testing import error_shapes, shapes


def scan(chunks: list[bytes]) -> None:
    hold = SseHold()
    for chunk in chunks:
        if hold.feed(chunk) is not HOLD:
            return
    hold.finish()


def parse_only(chunks: list[bytes]) -> None:
    for chunk in chunks:
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: "):
                with contextlib.suppress(orjson.JSONDecodeError):
                    orjson.loads(line[6:])


def heads() -> dict[str, list[bytes]]:
    openai = shapes.chat_completion_stream("gpt-4o", ["Hello", " world"], rid="chatcmpl-1")
    anthropic = shapes.anthropic_stream("claude", ["Hello", " world"], rid="msg_1")
    anthropic = [anthropic[0], error_shapes.anthropic_ping(), *anthropic[1:]]
    return {
        "OpenAI: role chunk, first content": openai[:2],
        "Anthropic: message_start, ping, block start, first delta": anthropic[:4],
        "OpenRouter: 10 keep-alives, role chunk, first content": [error_shapes.KEEPALIVE] * 10
        + openai[:2],
        "Anthropic: message_start, ping, overloaded_error": error_shapes.anthropic_error_stream(
            "claude", "msg_1"
        ),
        "worst case: 32,768 comment lines (64 KiB), one chunk": [b":\n" * 32768],
    }


def main() -> None:
    info = bl.machine()
    rows, data = [], {}
    for name, chunks in heads().items():
        n = 20 if name.startswith("worst") else 20000
        scan_us = per_call(lambda c=chunks: scan(c), n)  # type: ignore[misc]
        parse_us = per_call(lambda c=chunks: parse_only(c), n)  # type: ignore[misc]
        size = sum(map(len, chunks))
        ratio = scan_us / parse_us if parse_us else float("nan")
        rows.append([name, len(chunks), size, scan_us, parse_us, ratio])
        data[name] = {"chunks": len(chunks), "bytes": size, "scan_us": scan_us, "json_us": parse_us}
    table = bl.md_table(
        ["stream head", "chunks", "bytes", "scan us", "orjson-only us", "ratio"], rows
    )
    text = (
        "# Finding the SSE commit point: CPU per stream\n\n"
        f"`{bl.command_line()}`\n\n{bl.machine_md(info)}\n\n{table}\n\n"
        "After the decision the scanner is not called again: the rest of the stream is the\n"
        "same byte pump as before.\n"
    )
    (bl.RESULTS / "sse_hold.md").write_text(text)
    bl.write_json("sse_hold.json", {"machine": info, "heads": data})
    print(text)


if __name__ == "__main__":
    main()
