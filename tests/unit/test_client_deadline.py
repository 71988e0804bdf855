"""The client's announced deadline and retry count (:mod:`sidecar.client_deadline`)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.client_deadline import announced_timeout_s, is_client_retry, time_to_answer_s


def headers(**pairs: str) -> CIMultiDictProxy[str]:
    """Request headers as aiohttp gives them; ``x_stainless_timeout`` -> the header
    ``X-Stainless-Timeout`` (any case is the same header)."""
    return CIMultiDictProxy(CIMultiDict({k.replace("_", "-").title(): v for k, v in pairs.items()}))


# announced timeout (s) -> time the sidecar has until its 504 (s): 5 %, at least 100 ms
MARGIN_TABLE = [
    (600.0, 570.0),  # the SDKs' default 10 min: 30 s of margin
    (60.0, 57.0),
    (2.0, 1.9),  # 5 % is exactly 100 ms
    (1.0, 0.9),  # 5 % = 50 ms < 100 ms
    (0.5, 0.4),
    (0.1, 0.0),  # within the margin: answer at once
    (0.05, 0.0),  # never below zero
]


@pytest.mark.parametrize(("announced", "left"), MARGIN_TABLE)
def test_time_to_answer_is_the_timeout_less_five_percent_at_least_100_ms(
    announced: float, left: float
) -> None:
    assert time_to_answer_s(announced) == pytest.approx(left)


# header values -> the smallest valid announced timeout in seconds (None: none)
ANNOUNCED_TABLE: list[tuple[dict[str, str], float | None]] = [
    ({}, None),
    ({"x_stainless_read_timeout": "600"}, 600.0),  # the openai SDK's default, an int
    ({"x_stainless_read_timeout": "2.0"}, 2.0),
    ({"x_stainless_read_timeout": "12.5"}, 12.5),
    ({"x_stainless_timeout": "30"}, 30.0),  # the Anthropic SDK's
    ({"x_sidecar_timeout_ms": "1500"}, 1.5),
    # the smallest of all present wins
    ({"x_stainless_read_timeout": "600", "x_stainless_timeout": "30"}, 30.0),
    ({"x_stainless_read_timeout": "20", "x_stainless_timeout": "600"}, 20.0),
    ({"x_stainless_read_timeout": "20", "x_sidecar_timeout_ms": "5000"}, 5.0),
    ({"x_stainless_timeout": "4", "x_sidecar_timeout_ms": "5000"}, 4.0),
    # invalid values are ignored, as if absent
    ({"x_stainless_read_timeout": "abc"}, None),
    ({"x_stainless_read_timeout": "0"}, None),
    ({"x_stainless_read_timeout": "-5"}, None),
    ({"x_stainless_read_timeout": "nan"}, None),
    ({"x_stainless_read_timeout": "inf"}, None),
    ({"x_stainless_read_timeout": "None"}, None),
    ({"x_stainless_read_timeout": "\u0661\u0662"}, None),  # Arabic-Indic digits: not ASCII
    ({"x_sidecar_timeout_ms": "1.5"}, None),  # milliseconds are whole
    ({"x_sidecar_timeout_ms": "0"}, None),  # 0: no deadline (as Envoy's header)
    ({"x_sidecar_timeout_ms": "-1"}, None),
    ({"x_sidecar_timeout_ms": "\u00b2"}, None),  # a superscript 2 is a "digit" to str
    # an invalid one does not hide a valid one
    ({"x_stainless_read_timeout": "abc", "x_stainless_timeout": "7"}, 7.0),
    ({"x_stainless_read_timeout": "9", "x_sidecar_timeout_ms": "soon"}, 9.0),
]


@pytest.mark.parametrize(("pairs", "expected"), ANNOUNCED_TABLE)
def test_announced_timeout_is_the_smallest_valid_one(
    pairs: dict[str, str], expected: float | None
) -> None:
    assert announced_timeout_s(headers(**pairs)) == expected


def test_header_names_are_case_insensitive() -> None:
    raw = CIMultiDictProxy(CIMultiDict([("X-STAINLESS-READ-TIMEOUT", "3")]))
    assert announced_timeout_s(raw) == 3.0


RETRY_TABLE: list[tuple[str | None, bool]] = [
    (None, False),
    ("0", False),  # the SDK's first try
    ("1", True),
    ("2", True),
    ("10", True),
    ("", False),
    ("one", False),
    ("-1", False),
    ("1.0", False),
    ("\u0661", False),  # not ASCII
]


@pytest.mark.parametrize(("value", "retry"), RETRY_TABLE)
def test_a_retry_count_of_one_or_more_is_a_client_retry(value: str | None, retry: bool) -> None:
    pairs = {} if value is None else {"x_stainless_retry_count": value}
    assert is_client_retry(headers(**pairs)) is retry
