"""The access log's ``outcome`` rules (contract, "Logs"), as a table."""

from __future__ import annotations

import pytest

from sidecar.access_log import _OUTCOME_OF_ERROR, outcome
from sidecar.errors import ErrorCode


def test_every_error_code_of_the_sidecar_has_an_outcome() -> None:
    assert {c.code for c in ErrorCode} <= set(_OUTCOME_OF_ERROR)


@pytest.mark.parametrize(
    ("status", "error", "aborted", "client_left", "expected"),
    [
        (200, None, False, False, "ok"),
        (204, None, False, False, "ok"),
        (304, None, False, False, "ok"),
        (400, None, False, False, "caller_error"),
        (429, None, False, False, "caller_error"),
        (499, None, False, False, "caller_error"),  # an upstream's own 499, relayed
        (500, None, False, False, "upstream_error"),
        (503, None, False, False, "upstream_error"),
        (502, "upstream_unavailable", False, False, "upstream_error"),
        (504, "upstream_timeout", False, False, "upstream_error"),
        (503, "circuit_open", False, False, "circuit_open"),
        (429, "rate_limited", False, False, "rate_limited"),
        (503, "overloaded", False, False, "rejected"),
        (404, "no_route", False, False, "rejected"),
        (413, "request_too_large", False, False, "rejected"),
        (400, "bad_request", False, False, "rejected"),
        (200, None, True, False, "aborted"),
        (500, None, True, False, "aborted"),
        (499, None, False, True, "client_closed"),
        (499, None, True, True, "client_closed"),
    ],
)
def test_outcome(
    status: int, error: str | None, aborted: bool, client_left: bool, expected: str
) -> None:
    assert outcome(status, error, aborted, client_left) == expected
