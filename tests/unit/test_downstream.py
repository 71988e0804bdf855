"""Pins of the aiohttp steps ``sidecar.wire.downstream`` relies on (``.ci/run`` runs this
file on both ends of the declared aiohttp range).

``DownstreamConnection.handle_error`` answers 431 where the parser refused a head over
its limits: that is recognised by the exception the parser raises (``LineTooLong``, or
``BadHttpMessage("Too many headers received")``), from the C parser and the pure-Python
one alike, and ``RequestHandler.handle_error`` keeps its signature.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from aiohttp import http_parser
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestHandler

from sidecar.wire.downstream import TOO_MANY_HEADERS, DownstreamConnection, head_too_large

PARSERS: list[Any] = [http_parser.HttpRequestParserPy]
if http_parser.HttpRequestParserC is not http_parser.HttpRequestParserPy:
    PARSERS.append(http_parser.HttpRequestParserC)

HEADS = {
    "field_line": b"GET / HTTP/1.1\r\nHost: s\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    "request_line": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: s\r\n\r\n",
    "fields": b"GET / HTTP/1.1\r\nHost: s\r\n"
    + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
    + b"\r\n",
}


def parse_error(parser_class: Any, data: bytes) -> BaseException:
    loop = asyncio.new_event_loop()
    try:
        parser = parser_class(
            None, loop, 2**16, max_line_size=8190, max_field_size=8190, max_headers=128
        )
        with pytest.raises(BadHttpMessage) as caught:
            parser.feed_data(data)
        return caught.value
    finally:
        loop.close()


@pytest.mark.parametrize("parser_class", PARSERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_head_over_the_limits_is_recognised(parser_class: Any, name: str) -> None:
    assert head_too_large(parse_error(parser_class, HEADS[name]))


@pytest.mark.parametrize("parser_class", PARSERS, ids=lambda c: c.__name__)
def test_other_parser_errors_are_not_taken_for_a_head_too_large(parser_class: Any) -> None:
    exc = parse_error(parser_class, b"GET / HTTP/1.1\r\nHost: s\r\nX@A: v\r\n\r\n")
    assert not head_too_large(exc)
    assert TOO_MANY_HEADERS not in str(exc)


def test_handle_error_keeps_its_signature() -> None:
    assert list(inspect.signature(RequestHandler.handle_error).parameters) == list(
        inspect.signature(DownstreamConnection.handle_error).parameters
    )
