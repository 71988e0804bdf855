"""Token usage as the providers report it, read from an answer's bytes (pure, no IO).

Contract, "Tokens are metered": ``sidecar_tokens_total`` counts what the provider
reports, never an estimate. Three usage shapes, told apart by their field names:

=================  ==========================================  ==============================
kind               OpenAI-style (``prompt_tokens``...)          Anthropic / Responses API
=================  ==========================================  ==============================
``input``          ``prompt_tokens`` less                       Anthropic ``input_tokens``;
                   ``prompt_tokens_details.cached_tokens``      Responses ``input_tokens`` less
                                                                ``input_tokens_details.cached_tokens``
``output``         ``completion_tokens``                        ``output_tokens``
``cache_read``     ``prompt_tokens_details.cached_tokens``      ``cache_read_input_tokens``;
                                                                Responses ``cached_tokens``
``cache_write``    (not reported)                               ``cache_creation_input_tokens``
=================  ==========================================  ==============================

Where usage sits: a JSON answer's top-level ``usage`` (chat completions, Anthropic
messages, Responses objects, embeddings); in a stream, OpenAI's last chunk (only when
the client asked ``stream_options.include_usage``; the other chunks then carry
``"usage":null``), Anthropic's ``message_start`` (``message.usage``) and
``message_delta`` (``usage``, cumulative), the Responses API's ``response.completed``
/ ``response.incomplete`` / ``response.failed`` (``response.usage``). A later report
of a field replaces an earlier one (Anthropic's ``output_tokens`` grows from
``message_start`` to ``message_delta``).

:class:`Usage` reads a stream without parsing the events that carry no usage: each
chunk is searched for the bytes ``"usage"`` (a JSON key: a string value's own quotes
would be escaped), a ``"usage": null`` is passed over, and only the line holding a
usage object is parsed. Usage that cannot be read is ignored: metering never raises.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["KINDS", "LINE_LIMIT_BYTES", "Usage", "usage_of"]

KINDS = ("input", "output", "cache_read", "cache_write")
"""The ``kind`` label values of ``sidecar_tokens_total``, in the order of :meth:`Usage.kinds`."""
LINE_LIMIT_BYTES = 4 * 1024 * 1024
"""A stream line longer than this is not read for usage (its pieces are not kept)."""

_KEY = b'"usage"'
_SPACE = b" \t\r\n"


def usage_of(doc: Any) -> dict[str, Any] | None:
    """The usage object of a parsed JSON answer or stream event, or None.

    Looks at ``doc["usage"]``, then ``doc["message"]["usage"]`` (Anthropic's
    ``message_start``), then ``doc["response"]["usage"]`` (Responses API events).
    """
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if isinstance(usage, dict):
        return usage
    for outer in ("message", "response"):
        inner = doc.get(outer)
        if isinstance(inner, dict):
            usage = inner.get("usage")
            if isinstance(usage, dict):
                return usage
    return None


def _int(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


class Usage:
    """The tokens one answer reported so far: ``input``, ``output``, ``cache_read``,
    ``cache_write`` (int, or None when not reported).

    Fed with :meth:`take` (a parsed JSON answer) or :meth:`feed` (a stream's body
    chunks, in order, from its first byte; a line may be cut anywhere).
    """

    __slots__ = ("_pending", "_pending_size", "cache_read", "cache_write", "input", "output")

    def __init__(self) -> None:
        self.input: int | None = None
        self.output: int | None = None
        self.cache_read: int | None = None
        self.cache_write: int | None = None
        self._pending: list[bytes] | None = None  # the pieces of a line cut by a chunk's end
        self._pending_size = 0

    @property
    def reported(self) -> bool:
        """True when any kind was reported."""
        return (
            self.input is not None
            or self.output is not None
            or self.cache_read is not None
            or self.cache_write is not None
        )

    def kinds(self) -> tuple[int | None, int | None, int | None, int | None]:
        """``(input, output, cache_read, cache_write)``, as :data:`KINDS` names them."""
        return (self.input, self.output, self.cache_read, self.cache_write)

    def take(self, doc: Any) -> None:
        """Read the usage of a parsed JSON answer or event (see :func:`usage_of`), if any."""
        usage = doc.get("usage") if type(doc) is dict else None  # the common place, inline
        if type(usage) is not dict:
            usage = usage_of(doc)
        if usage is not None:
            self._merge(usage)

    def feed(self, chunk: bytes) -> None:
        """Read the usage in the next body chunk of an event stream, if any.

        Cost when the chunk holds no ``"usage"`` key and ends a line: one byte search.
        """
        pending = self._pending
        if pending is not None:  # the chunk goes on a line cut by the last one
            nl = chunk.find(b"\n")
            if nl < 0:
                self._keep(chunk)
                return
            self._pending = None
            if self._pending_size <= LINE_LIMIT_BYTES:
                pending.append(chunk[: nl + 1])
                self._scan(b"".join(pending))
            chunk = chunk[nl + 1 :]
        # ``chunk.find(_KEY) >= 0``, not ``_KEY in chunk``: CPython 3.11's bytes ``in``
        # first tries its operand as an integer and builds and drops a TypeError each time.
        if chunk[-1:] == b"\n":
            if chunk.find(_KEY) >= 0:
                self._scan(chunk)
            return
        if not chunk:
            return
        nl = chunk.rfind(b"\n")
        if nl >= 0 and chunk.find(_KEY) >= 0:
            self._scan(chunk[: nl + 1])
        self._pending = []
        self._pending_size = 0
        self._keep(chunk[nl + 1 :])

    # -- internals -------------------------------------------------------------

    def _keep(self, piece: bytes) -> None:
        """Keep ``piece`` of the cut line (dropped, with what was kept, past the limit)."""
        pending = self._pending
        assert pending is not None
        self._pending_size += len(piece)
        if self._pending_size <= LINE_LIMIT_BYTES:
            pending.append(piece)
        else:
            pending.clear()

    def _scan(self, data: bytes) -> None:
        """Parse each whole line of ``data`` that holds a usage object."""
        start = 0
        while (i := data.find(_KEY, start)) >= 0:
            j = i + len(_KEY)
            n = len(data)
            while j < n and data[j] in _SPACE:
                j += 1
            line_end = data.find(b"\n", i)
            if line_end < 0:
                line_end = n
            if j < n and data[j] == 0x3A:  # ':'
                j += 1
                while j < n and data[j] in _SPACE:
                    j += 1
                if data.startswith(b"{", j):
                    self._parse_line(data[data.rfind(b"\n", 0, i) + 1 : line_end])
                    start = line_end
                    continue
            start = j

    def _parse_line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        try:
            doc = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            return
        self.take(doc)

    def _merge(self, usage: dict[str, Any]) -> None:
        get = usage.get
        prompt = get("prompt_tokens")
        output = get("completion_tokens")
        if prompt is not None or output is not None:  # OpenAI-style
            details = get("prompt_tokens_details")
            cached = _int(details.get("cached_tokens")) if type(details) is dict else None
            if type(prompt) is int and prompt >= 0:
                self.input = prompt - cached if cached is not None and cached <= prompt else prompt
            if cached is not None:
                self.cache_read = cached
            if type(output) is int and output >= 0:
                self.output = output
            return
        inp = _int(get("input_tokens"))
        details = get("input_tokens_details")
        if isinstance(details, dict):  # Responses API: input_tokens includes the cached ones
            cached = _int(details.get("cached_tokens"))
            if inp is not None:
                self.input = inp - cached if cached is not None and cached <= inp else inp
            if cached is not None:
                self.cache_read = cached
        elif inp is not None:
            self.input = inp
        output = _int(get("output_tokens"))
        if output is not None:
            self.output = output
        read = _int(get("cache_read_input_tokens"))
        if read is not None:
            self.cache_read = read
        write = _int(get("cache_creation_input_tokens"))
        if write is not None:
            self.cache_write = write
