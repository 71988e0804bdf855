"""Request bodies as JSON (pure): the ``model`` for routing, and the candidate model rewrite.

Contract, "The proxy port": only a candidate's ``model`` rewrites the JSON
``model`` field; nothing else is parsed or changed. The body is parsed only
when a route or candidate needs its ``model``. orjson parses; the rewrite
replaces the top-level ``model`` value in the received bytes, so every other
byte stays as the client sent it (re-serializing would, for one, turn integers
over 64 bits into floats).
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_JSON_OBJECT_START = re.compile(rb"[ \t\n\r]*\{")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object (a dict), or None when it is not one.

    orjson first; an object it refuses although it is valid JSON (a lone surrogate
    escape such as ``"\\ud83d"`` from a string cut mid-emoji, a number beyond a
    double) is parsed by the standard library, so that routing and the model
    rewrite see the document the provider will.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        if not _JSON_OBJECT_START.match(body):
            return None
        try:
            doc = json.loads(body, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
    return doc if isinstance(doc, dict) else None


def body_model(body: bytes) -> str | None:
    """The JSON body's top-level ``model`` string, or None (not JSON, no string ``model``)."""
    doc = json_object(body)
    value = doc.get("model") if doc is not None else None
    return value if isinstance(value, str) else None


_JSON_WS = re.compile(r"[ \t\n\r]*")
_JSON_SCAN = json.JSONDecoder()


def _skip_ws(text: str, i: int) -> int:
    m = _JSON_WS.match(text, i)
    return m.end() if m is not None else i


_JSON_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
"""A JSON string (skipped whole, brackets inside it included) or a bracket."""


def _value_end(text: str, i: int) -> int:
    """End of the JSON value starting at ``text[i]`` (already validated by the parser).

    Arrays and objects are skipped by counting brackets, not by decoding them: the
    decoder recurses per level and raised RecursionError (a bare 500) on a body
    nested deeper than Python's recursion limit but within orjson's (1024).
    """
    if text[i] not in "[{":
        return int(_JSON_SCAN.raw_decode(text, i)[1])
    depth = 0
    for m in _JSON_NESTING.finditer(text, i):
        c = m.group()
        if c in ("[", "{"):
            depth += 1
        elif c in ("]", "}"):
            depth -= 1
            if depth == 0:
                return m.end()
    raise ValueError("unterminated value")


def _model_value_span(text: str) -> tuple[int, int] | None:
    """Character span of the top-level ``"model"`` value of a JSON object text (the
    last one, as parsers keep it), or None when there is none.

    :raises ValueError | IndexError: the text is not a JSON object after all.
    """
    i = _skip_ws(text, 0)
    if text[i] != "{":
        raise ValueError("not an object")
    i += 1
    span = None
    while True:
        i = _skip_ws(text, i)
        if text[i] == "}":
            return span
        if text[i] != '"':
            raise ValueError("key expected")
        key, i = _JSON_SCAN.raw_decode(text, i)
        i = _skip_ws(text, i)
        if text[i] != ":":
            raise ValueError("colon expected")
        i = _skip_ws(text, i + 1)
        end = _value_end(text, i)
        if key == "model":
            span = (i, end)
        i = _skip_ws(text, end)
        if text[i] == ",":
            i += 1


def rewrite_model(body: bytes, model: str) -> bytes:
    """The body with its JSON ``model`` set to ``model``; other bodies unchanged.

    Only the value of the top-level ``model`` is replaced in the original bytes:
    every other byte stays as the client sent it (re-serializing would turn
    integers over 64 bits into floats). A body without ``model`` gets one.
    """
    doc = json_object(body)
    if doc is None:
        return body
    value = orjson.dumps(model).decode()
    try:
        text = body.decode("utf-8")
        span = _model_value_span(text)
    except (ValueError, IndexError):
        span, text = None, ""
    if span is not None:
        return (text[: span[0]] + value + text[span[1] :]).encode("utf-8")
    if text and doc:  # no "model" key: add one first
        brace = text.index("{") + 1
        return (text[:brace] + f'"model":{value},' + text[brace:]).encode("utf-8")
    doc["model"] = model
    return orjson.dumps(doc)
