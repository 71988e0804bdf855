"""The SSE commit point: hold events without output, judge the first one that has some (pure).

Contract, "The proxy port", "Streamed answers": for a 2xx ``text/event-stream``
answer the commit point is the first event that carries output. Events without
output are held, never relayed on their own:

- SSE comment lines (``:`` ...) and blocks that dispatch no event (no ``data``
  line: ``event:``/``id:``/``retry:`` alone);
- Anthropic's ``message_start``, ``content_block_start`` and ``ping`` (by the
  ``event:`` field, or by the JSON ``type`` when the event has no name);
- the Responses API's lifecycle events ``response.created``, ``response.queued``,
  ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.reasoning_summary_part.added``;
- OpenAI-style chunks (a JSON object with a ``choices`` list) in which no
  choice's ``delta`` has a non-empty ``content``, ``refusal``, ``reasoning_content``
  or ``reasoning``, non-empty ``tool_calls``, or a non-null ``function_call`` (the
  role-only first chunk, ``choices: []``);
- closing events: Anthropic's ``content_block_stop`` and ``message_delta``, the
  Responses API's ``*.done`` events.

**Reasoning is output**: ``reasoning_content`` / ``reasoning`` deltas, Anthropic's
``thinking_delta`` (a ``content_block_delta`` like any other) and every Responses API
event whose type ends in ``.delta`` commit.

An *error event* (``event: error``, a JSON object with a non-null top-level
``error``, or the Responses API's ``response.failed``, whose error is at
``response.error``) before any output ends the scan: a caller's error type
(:data:`CALLER_ERROR_TYPES`) is relayed as it came (neutral); any other type,
an unrecognised one included, is the provider's failure (outcome ``sse_error``).
The type is read at ``error.type``, else ``error.code`` (OpenAI/vLLM put it in
``type``, OpenRouter in ``code``; the Responses API's ``error`` event has ``code``
at the top level); the first one that names a known type wins.

The **end of a turn** with no output and no error (``data: [DONE]``, Anthropic's
``message_stop``, the Responses API's ``response.completed`` or
``response.incomplete``, or the end of a non-empty body) is an *empty turn*
(contract, "An empty turn is a failure"), unless a length cut ended it: a choice's
``finish_reason`` ``length``, Anthropic's ``stop_reason`` ``max_tokens`` (in
``message_delta``), a Responses ``incomplete_details.reason`` of
``max_output_tokens``; that one commits (``reason="length"``).

Every other event carries output and commits. More than :data:`HOLD_LIMIT_BYTES`
received with no decision commits anyway; an empty body commits at its end.

Framing follows the WHATWG HTML "event stream interpretation": lines end in LF,
CRLF or CR (a CRLF may be split across chunks), one leading UTF-8 BOM is
ignored, ``field: value`` loses one space after the colon, a blank line
dispatches the event, ``data`` lines join with LF.

:class:`SseHold` is fed the body chunks as they arrive; each byte is scanned
once (the held chunks are kept, not re-read). Once it returns a decision other
than ``HOLD`` it is done: the caller writes :attr:`Decision.data` in one write
and from then on pumps the body without consulting it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "CALLER_ERROR_TYPES",
    "HOLD",
    "HOLD_LIMIT_BYTES",
    "PROVIDER_ERROR_TYPES",
    "RATE_LIMIT_ERROR_TYPES",
    "Decision",
    "SseHold",
    "Verdict",
    "holds_events",
]

HOLD_LIMIT_BYTES = 64 * 1024
"""At most this many bytes are held; one more byte without a decision commits."""

CALLER_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "invalid_prompt",
    }
)
"""Error-event types that are the caller's fault: relayed as they came, neutral."""

PROVIDER_ERROR_TYPES = frozenset(
    {"overloaded_error", "api_error", "rate_limit_error", "server_error", "rate_limit_exceeded"}
)
"""The provider error types the contract names; any unrecognised type is one too."""

RATE_LIMIT_ERROR_TYPES = frozenset({"rate_limit_error", "rate_limit_exceeded"})
"""The provider error types that say "this key is over its limit" (Anthropic's
``rate_limit_error``, OpenAI's ``rate_limit_exceeded``)."""

_HOLD_NAMES = frozenset(
    {
        "message_start",
        "content_block_start",
        "ping",
        "content_block_stop",
        "message_delta",
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_summary_part.added",
    }
)
_TURN_ENDS = frozenset({"message_stop", "response.completed", "response.incomplete"})
_BOM = b"\xef\xbb\xbf"


class Verdict(enum.Enum):
    """What one feed decided."""

    HOLD = "hold"
    """No output yet: keep the bytes back, feed the next chunk."""
    COMMIT = "commit"
    """Commit now: write :attr:`Decision.data` to the client in one write."""
    PROVIDER_ERROR = "provider_error"
    """The provider's error event before any output: a failure (``sse_error``)."""
    RATE_LIMIT_ERROR = "rate_limit_error"
    """A ``PROVIDER_ERROR`` whose type is a rate limit (:data:`RATE_LIMIT_ERROR_TYPES`):
    :class:`SseHold` itself says ``PROVIDER_ERROR`` with the type as its reason;
    :func:`sidecar.commit_input.read_commit_input` tells this one apart, for
    ``rate_limit_scope``."""
    CALLER_ERROR = "caller_error"
    """A caller's error event before any output: relay :attr:`Decision.data` as it came."""
    EMPTY = "empty"
    """The turn ended with no output, no error and no length cut: an empty turn."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The scanner's answer to one feed (or to :meth:`SseHold.finish`).

    ``data``: for every verdict but ``HOLD``, every byte fed so far, unchanged
    and in order (the held bytes, the deciding event, and whatever followed it
    in the same chunk); ``b""`` for ``HOLD``. ``reason``: for ``COMMIT``
    ``"output"`` (an event with output), ``"limit"`` (more than
    :data:`HOLD_LIMIT_BYTES` held), ``"length"`` (the turn ended with no output, cut
    by the caller's length limit) or ``"end"`` (an empty body); for ``EMPTY``
    ``"empty"``; for the
    error verdicts the error type found (``"overloaded_error"``), or
    ``"unrecognised"`` when the event names none; ``""`` for ``HOLD``.
    """

    verdict: Verdict
    data: bytes = b""
    reason: str = ""


HOLD = Decision(Verdict.HOLD)
"""The one ``HOLD`` decision (no allocation per held chunk)."""


def holds_events(status: int, headers: Mapping[str, str]) -> bool:
    """True when the answer's commit point is found by :class:`SseHold`.

    A 2xx whose ``Content-Type`` media type is ``text/event-stream`` (any case,
    parameters ignored). ``headers`` must look names up in any case (aiohttp's
    ``CIMultiDictProxy``). A compressed body (a ``Content-Encoding`` other than
    ``identity``) is relayed untouched and cannot be read, so it commits at the
    first chunk as any other body does.
    """
    if not 200 <= status < 300:
        return False
    media = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    encoding = headers.get("Content-Encoding", "identity").strip().lower()
    return media == "text/event-stream" and encoding in ("", "identity")


class SseHold:
    """Incremental commit-point scanner for one streamed answer (one attempt).

    Call :meth:`feed` with each body chunk as it arrives until it returns a
    decision other than ``HOLD``; call :meth:`finish` at the end of the body if
    that comes first. After a decision the scanner must not be fed again
    (:class:`RuntimeError`): the relay pumps the rest of the body itself.
    """

    __slots__ = (
        "_chunks", "_data", "_done", "_event", "_length", "_line", "_pos", "_skip_lf", "_start",
    )  # fmt: skip

    def __init__(self) -> None:
        self._chunks: list[bytes] = []  # every chunk fed, joined once at the decision
        self._pos = 0  # bytes fed so far
        self._done = False
        self._start: bytearray | None = bytearray()  # first bytes, until a BOM is ruled out
        self._line = bytearray()  # the current line's bytes so far, no terminator
        self._skip_lf = False  # the last line ended in CR: a leading LF completes its CRLF
        self._event: bytes | None = None  # the current event's ``event`` field
        self._data: list[bytes] = []  # the current event's ``data`` lines
        self._length = False  # a length cut was seen (finish_reason "length"...)

    @property
    def held_bytes(self) -> int:
        """Bytes fed so far (all of them held until a decision)."""
        return self._pos

    def feed(self, chunk: bytes) -> Decision:
        """Scan ``chunk``, the next body bytes (an event or a CRLF may be cut anywhere).

        Only the first :data:`HOLD_LIMIT_BYTES` of the body are scanned, so the
        decision does not depend on where the body was cut into chunks.

        :raises RuntimeError: when a decision was already returned.
        """
        if self._done:
            raise RuntimeError("SseHold already decided; relay the rest of the body directly")
        self._chunks.append(chunk)
        room = HOLD_LIMIT_BYTES - self._pos
        self._pos += len(chunk)
        part = chunk if len(chunk) <= room else chunk[: max(room, 0)]
        if self._start is not None:
            self._start += part
            if len(self._start) < len(_BOM) and _BOM.startswith(self._start):
                return HOLD
            part = bytes(self._start)
            self._start = None
            if part.startswith(_BOM):
                part = part[len(_BOM) :]
        decision = self._scan(part)
        if decision is not None:
            return decision
        if self._pos > HOLD_LIMIT_BYTES:
            return self._decide(Verdict.COMMIT, "limit")
        return HOLD

    def finish(self) -> Decision:
        """The body ended with no decision: judge the last, unterminated event (a
        provider that closes right after its error event may omit the blank line),
        else the turn ended with no output: ``EMPTY`` (or ``COMMIT`` with
        ``reason="length"`` after a length cut); an empty body commits
        (``reason="end"``, ``data`` ``b""``).

        :raises RuntimeError: when a decision was already returned.
        """
        if self._done:
            raise RuntimeError("SseHold already decided")
        self._start = None  # fewer than 3 bytes, all of a BOM: nothing to read
        if self._line:
            self._take_line(bytes(self._line))
            self._line.clear()
        if self._data and (decision := self._dispatch()) is not None:
            return decision
        if self._pos == 0:
            return self._decide(Verdict.COMMIT, "end")
        return self._end_turn()

    # -- internals -------------------------------------------------------------

    def _decide(self, verdict: Verdict, reason: str) -> Decision:
        self._done = True
        data = b"".join(self._chunks)
        self._chunks = []
        return Decision(verdict, data, reason)

    def _scan(self, data: bytes) -> Decision | None:
        """Scan ``data`` line by line: a decision, or None to keep holding."""
        if self._skip_lf and data[:1] == b"\n":
            data = data[1:]  # the LF of a CRLF cut after its CR
        self._skip_lf = False
        if not data:
            return None
        pieces = data.splitlines(keepends=True)  # bytes: splits at LF, CRLF and CR only
        tail = pieces.pop() if pieces[-1][-1:] not in (b"\n", b"\r") else b""
        for piece in pieces:
            line = piece.rstrip(b"\r\n")
            if self._line:
                self._line += line
                line = bytes(self._line)
                self._line.clear()
            if line:
                self._take_line(line)
            elif self._data:
                if (decision := self._dispatch()) is not None:
                    return decision
            else:
                self._event = None  # a blank line with no data dispatches nothing
        self._line += tail
        self._skip_lf = data[-1:] == b"\r"
        return None

    def _take_line(self, line: bytes) -> None:
        if line[:1] == b":":
            return  # a comment
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value

    def _end_turn(self) -> Decision:
        """The turn ended with no output and no error."""
        if self._length:
            return self._decide(Verdict.COMMIT, "length")
        return self._decide(Verdict.EMPTY, "empty")

    def _dispatch(self) -> Decision | None:
        """Judge the event just ended; None when it carries no output (held)."""
        event, data = self._event, b"\n".join(self._data)
        self._event, self._data = None, []
        if data == b"[DONE]":
            return self._end_turn()
        try:
            doc: Any = orjson.loads(data)
        except orjson.JSONDecodeError:
            doc = None
        if event == b"error" or (isinstance(doc, dict) and doc.get("error") is not None):
            return self._error(_error_type(doc))
        name = event.decode("utf-8", "replace") if event else None
        if name is None and isinstance(doc, dict) and isinstance(doc.get("type"), str):
            name = doc["type"]
        if name is not None:
            if name in _HOLD_NAMES:
                if name == "message_delta" and _stop_reason(doc) == "max_tokens":
                    self._length = True
                return None
            if name in _TURN_ENDS:
                if name == "response.incomplete" and _incomplete_reason(doc) == "max_output_tokens":
                    self._length = True
                return self._end_turn()
            if name.startswith("response."):
                if name == "response.failed":
                    inner = doc.get("response") if isinstance(doc, dict) else None
                    return self._error(_error_type(inner))
                if name.endswith(".done"):
                    return None
        choices = doc.get("choices") if isinstance(doc, dict) else None
        if isinstance(choices, list) and not any(_choice_has_output(c) for c in choices):
            if any(isinstance(c, dict) and c.get("finish_reason") == "length" for c in choices):
                self._length = True
            return None
        return self._decide(Verdict.COMMIT, "output")

    def _error(self, kind: str) -> Decision:
        verdict = Verdict.CALLER_ERROR if kind in CALLER_ERROR_TYPES else Verdict.PROVIDER_ERROR
        return self._decide(verdict, kind)


def _stop_reason(doc: Any) -> Any:
    """Anthropic ``message_delta``'s ``delta.stop_reason``."""
    delta = doc.get("delta") if isinstance(doc, dict) else None
    return delta.get("stop_reason") if isinstance(delta, dict) else None


def _incomplete_reason(doc: Any) -> Any:
    """A Responses event's ``response.incomplete_details.reason``."""
    resp = doc.get("response") if isinstance(doc, dict) else None
    details = resp.get("incomplete_details") if isinstance(resp, dict) else None
    return details.get("reason") if isinstance(details, dict) else None


def _choice_has_output(choice: Any) -> bool:
    """A choice carries output unless its ``delta`` is a dict without any."""
    delta = choice.get("delta") if isinstance(choice, dict) else None
    if not isinstance(delta, dict):
        return True  # not a chat delta (legacy ``text`` choices...): do not hold it
    return bool(
        delta.get("content")
        or delta.get("refusal")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
        or delta.get("function_call") is not None
    )


def _error_type(doc: Any) -> str:
    """The error type of an error event's JSON: ``error.type``, else ``error.code``,
    the first that is a known type; else the first string found; else ``unrecognised``.
    Without an ``error`` object (the Responses API's ``error`` event, or
    ``response.error`` passed in), ``type`` and ``code`` are read on ``doc`` itself."""
    if not isinstance(doc, dict):
        return "unrecognised"
    err = doc.get("error")
    if not isinstance(err, dict):
        err = doc
    names = [
        v for v in (err.get("type"), err.get("code")) if isinstance(v, str) and v and v != "error"
    ]
    for v in names:
        if v in CALLER_ERROR_TYPES or v in PROVIDER_ERROR_TYPES:
            return v
    return names[0] if names else "unrecognised"
