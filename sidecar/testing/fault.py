"""`Fault`: how the fake upstream answers (or misbehaves on) one request; `ReceivedRequest`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from multidict import CIMultiDict

from . import error_shapes, turn_shapes

__all__ = ["SHAPES", "WIRE_FIELDS", "Fault", "ReceivedRequest", "fault_from_json"]

SHAPES: frozenset[str] = error_shapes.SHAPES | turn_shapes.SHAPES
"""Every name ``Fault(shape=...)`` takes: the error answers of
:data:`~sidecar.testing.error_shapes.SHAPES` and the whole turns of
:data:`~sidecar.testing.turn_shapes.SHAPES` (two disjoint sets)."""


@dataclass(frozen=True)
class Fault:
    """One response behaviour of :class:`~sidecar.testing.FakeUpstream`. All fields optional.

    ``Fault()`` is a healthy answer: 200 with a generated OpenAI/Anthropic body.
    Durations are **milliseconds** (``float``). A *body chunk* is one write to the
    socket: for SSE answers one event (see :mod:`sidecar.testing.shapes` for the
    event lists), for any other body one of ``chunks`` consecutive slices of it.
    The steps run in this order, each fault field acting at its step:

    1. request read and recorded; ``reset_before_headers`` closes the connection here;
    2. ``delay_headers_ms``, then ``hold_headers``; then status and headers are sent;
    3. ``reset_after_headers`` closes the connection before any body byte;
    4. before body chunk ``i`` (``i = 0 .. n``, where ``i == n`` is "after the last
       chunk, before the end of the body"): ``delay_first_chunk_ms`` (i == 0) or
       ``chunk_delay_ms`` (0 < i < n), ``hold_first_chunk`` (i == 0),
       ``hold_after_chunks`` (its i), the stall (``stall``: i == 0,
       ``stall_after_chunks``: its i), then ``reset_after_chunks`` (its i);
    5. the body is ended (chunked terminator or complete Content-Length).

    A "reset" aborts the transport (no flush of aiohttp's buffer, but bytes already
    written are flushed to the kernel first): the socket is closed with a FIN, so
    an aiohttp client sees ``ServerDisconnectedError`` before headers and
    ``ClientPayloadError`` mid-body.

    The ``hold_*`` fields are :class:`asyncio.Event` gates for tests: the response
    waits until the event is set, with no wall-clock sleeping. They cannot be
    set through the ``x-fake-fault`` header.
    """

    status: int = 200
    """HTTP status. >= 400 without ``body`` generates the provider's error JSON
    (Anthropic's shape on ``/messages`` paths, OpenAI's elsewhere), never SSE."""
    retry_after: str | None = None
    """``Retry-After`` header value, sent as given (``"2"``, an HTTP date, garbage)."""
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Extra response headers; they override generated ones (``Content-Type``...)."""
    content_type: str | None = None
    """Override of the generated ``Content-Type``."""
    body: bytes | None = None
    """Exact raw body to send instead of a generated one (split into ``chunks`` writes)."""
    text: str | None = None
    """Reply text of generated bodies, split in ``chunks`` pieces (default: DEFAULT_WORDS)."""
    chunks: int = 5
    """SSE: number of content events (deltas). Other bodies: number of writes."""
    empty_body: bool = False
    """Send the status with ``Content-Length: 0`` and no body."""
    gzip: bool = False
    """Gzip the body (``Content-Encoding: gzip``); each chunk is sync-flushed so it
    is decompressible as it arrives. Ignored for an empty body."""
    keep_alive: bool = True
    """False: answer with ``Connection: close`` and close the connection afterwards."""
    delay_headers_ms: float = 0
    """Wall-clock wait (ms) before sending status and headers."""
    delay_first_chunk_ms: float = 0
    """Wall-clock wait (ms) after the headers, before the first body chunk."""
    chunk_delay_ms: float = 0
    """Wall-clock gap (ms) between consecutive body chunks."""
    reset_before_headers: bool = False
    """Close the TCP connection without sending any response byte."""
    reset_after_headers: bool = False
    """Send status and headers, then close the connection before any body byte."""
    reset_after_chunks: int | None = None
    """Send this many body chunks, then close the connection (the body never ends)."""
    stall: bool = False
    """After the headers, send nothing until :meth:`FakeUpstream.release` or close."""
    stall_after_chunks: int | None = None
    """Like ``stall``, after this many body chunks."""
    shape: str | None = None
    """A provider's answer byte for byte, by name (:data:`SHAPES`). Error answers
    (:mod:`~sidecar.testing.error_shapes`): ``"anthropic_overloaded"``
    (``message_start``, ``ping``, ``event: error``), ``"openai_server_error"``
    (role-only chunk, ``data: {"error": ...}``), the ``*_invalid_request``
    caller-error streams, the ``*_context_window`` 400 bodies. Whole turns
    (:mod:`~sidecar.testing.turn_shapes`): reasoning streams, empty turns, answers
    whose usage has cached tokens, e.g. ``"anthropic_thinking_stream"``,
    ``"responses_failed_stream"``, ``"openai_empty_json"``. It sets the status and
    the body (one write per event or body); the route and ``stream`` do not matter."""
    keepalives: int = 0
    """SSE answers: send this many keep-alive comments (``: OPENROUTER PROCESSING``)
    first, one write each, before the events."""
    hold_headers: asyncio.Event | None = field(default=None, compare=False)
    """Wait for this event before sending status and headers."""
    hold_first_chunk: asyncio.Event | None = field(default=None, compare=False)
    """Wait for this event after the headers, before the first body chunk."""
    hold_after_chunks: tuple[int, asyncio.Event] | None = field(default=None, compare=False)
    """``(n, event)``: after ``n`` body chunks, wait for ``event``."""

    def __post_init__(self) -> None:
        if self.shape is not None and self.shape not in SHAPES:
            raise ValueError(f"shape: unknown shape {self.shape!r}")
        if self.keepalives < 0:
            raise ValueError("keepalives: must be >= 0")


WIRE_FIELDS: frozenset[str] = frozenset(
    f.name for f in dataclasses.fields(Fault) if not f.name.startswith("hold_")
)
"""Fault fields settable through the ``x-fake-fault`` JSON header."""


def fault_from_json(raw: str | bytes, base: Fault | None = None) -> Fault:
    """Parse a JSON object of :data:`WIRE_FIELDS` into a :class:`Fault`.

    Unnamed fields keep ``base``'s values (default ``Fault()``). ``body`` is a
    string (sent UTF-8 encoded). Raises :class:`ValueError` on bad JSON, unknown
    fields or wrong types, e.g. ``{"status": 503, "retry_after": "1"}``.
    """
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(data) - WIRE_FIELDS)
    if unknown:
        raise ValueError(f"unknown fault fields: {', '.join(unknown)}")
    hints = typing.get_type_hints(Fault)
    hints["body"] = str | None
    hints["headers"] = dict[str, str]
    values: dict[str, Any] = {}
    for name, value in data.items():
        try:
            values[name] = msgspec.convert(value, type=hints[name])
        except msgspec.ValidationError as exc:
            raise ValueError(f"{name}: {exc}") from None
    if isinstance(values.get("body"), str):
        values["body"] = values["body"].encode()
    return dataclasses.replace(base or Fault(), **values)


@dataclass(frozen=True)
class ReceivedRequest:
    """A request as the fake upstream received it, with the fault chosen for it."""

    index: int
    """1-based order of arrival (also sent back in the ``x-fake-request`` header)."""
    method: str
    path: str
    """The path without the query string."""
    query_string: str
    headers: CIMultiDict[str]
    """A copy of the request headers, duplicates and case kept."""
    body: bytes
    model: str | None
    """The JSON body's ``model`` when it is a string, else ``None``."""
    stream: bool
    """The JSON body has ``"stream": true``."""
    fault: Fault
    """The fault chosen for this request."""
    connection: int
    """1-based ordinal of the TCP connection it came on (0 when served outside ``start()``)."""

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)
