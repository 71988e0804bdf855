"""The steps of aiohttp's ``StreamReader`` that ``sidecar.wire.push_pump`` relies on.

The pump empties the reader with ``read_nowait()`` from the upstream connection's
data callback, and sets the reader's low-water mark below zero so that its reads
never resume the upstream's reading (the pump resumes it after a drain). If an
aiohttp release changes one of these steps, this fails by name, before a stream
stalls or the pump double-reads.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import StreamReader


class Protocol:
    """What a reader calls on its protocol: counts of pauses and resumes."""

    def __init__(self) -> None:
        self.paused = 0
        self.resumed = 0
        self.connected = True

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self, resume_parser: bool = True) -> None:
        self.resumed += 1


LIMIT = 2**16


def reader(loop: asyncio.AbstractEventLoop) -> tuple[StreamReader, Protocol]:
    proto = Protocol()
    return StreamReader(proto, LIMIT, loop=loop), proto  # type: ignore[arg-type]


async def test_read_nowait_takes_every_chunk_held_and_nothing_when_empty() -> None:
    r, proto = reader(asyncio.get_running_loop())
    r._low_water = -1  # as PushPump.run sets it
    assert r.read_nowait() == b""
    r.feed_data(b"data: 1\n\n")
    r.feed_data(b"data: 2\n\n")
    assert r.read_nowait() == b"data: 1\n\ndata: 2\n\n"
    assert r.read_nowait() == b""
    assert proto.resumed == 0  # no resume per read below a negative low-water mark


async def test_without_the_pumps_low_water_mark_each_read_resumes_the_protocol() -> None:
    """The cost the pump avoids (and the proof that the test above can fail)."""
    r, proto = reader(asyncio.get_running_loop())
    r.feed_data(b"data: 1\n\n")
    assert r.read_nowait() == b"data: 1\n\n"
    assert proto.resumed == 1


async def test_a_reader_over_its_high_water_mark_pauses_the_upstream() -> None:
    r, proto = reader(asyncio.get_running_loop())
    r._low_water = -1
    r.feed_data(b"x" * (2 * LIMIT))
    assert proto.paused == 0
    r.feed_data(b"x")
    assert proto.paused == 1
    assert len(r.read_nowait()) == 2 * LIMIT + 1
    assert proto.resumed == 0  # the pump resumes the upstream itself


async def test_read_nowait_raises_the_readers_failure_and_eof_is_seen() -> None:
    loop = asyncio.get_running_loop()
    r, _ = reader(loop)
    r.feed_data(b"held")
    r.set_exception(ConnectionResetError("cut"))
    with pytest.raises(ConnectionResetError):
        r.read_nowait()
    done, _ = reader(loop)
    done.feed_data(b"last")
    done.feed_eof()
    assert done.is_eof()
    assert done.read_nowait() == b"last"
    assert done.read_nowait() == b""
