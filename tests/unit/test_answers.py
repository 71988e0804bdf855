"""Every way the sidecar answers itself maps to exactly one contract error answer."""

from __future__ import annotations

import orjson
import pytest

from sidecar.answers import Failure, deadline_failure, error_answer, upstream_failure
from sidecar.errors import ErrorCode
from sidecar.outcome import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamResetError,
    UpstreamTimeout,
)

CONTRACT_STATUS = {
    ErrorCode.CIRCUIT_OPEN: 503,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.UPSTREAM_UNAVAILABLE: 502,
    ErrorCode.UPSTREAM_TIMEOUT: 504,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.NO_ROUTE: 404,
    ErrorCode.REQUEST_TOO_LARGE: 413,
    ErrorCode.BAD_REQUEST: 400,
}
"""The contract's table of responses the sidecar makes itself."""

CLOSES = {
    Failure.NOT_A_PATH,
    Failure.NO_HOST,
    Failure.INVALID_HOST,
    Failure.BODY_TIMEOUT,
    Failure.BODY_TOO_LARGE,
}


@pytest.mark.parametrize("failure", list(Failure))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_every_failure_maps_to_one_contract_answer(failure: Failure, path: str) -> None:
    resp = error_answer(failure, path, 3)
    assert resp.status == CONTRACT_STATUS[failure.code]
    assert resp.headers["x-sidecar-error"] == failure.code.code
    assert resp.headers["x-sidecar-attempts"] == "3"
    assert resp.content_type == "application/json"
    assert resp.body is not None
    doc = orjson.loads(bytes(resp.body))  # type: ignore[arg-type]
    if path == "/v1/messages":
        assert doc["type"] == "error" and doc["error"]["message"]
    else:
        assert doc["error"]["code"] == failure.code.code and doc["error"]["message"]
    assert resp.keep_alive is (False if failure in CLOSES else None)


def test_every_error_code_is_reachable() -> None:
    assert {f.code for f in Failure} == set(ErrorCode)


def test_circuit_open_carries_retry_after() -> None:
    assert error_answer(Failure.ALL_OPEN, "/v1/x", 0, retry_after=7).headers["Retry-After"] == "7"


@pytest.mark.parametrize(
    ("err", "failure"),
    [
        (UpstreamConnectError("x"), Failure.CONNECT_ERROR),
        (UpstreamResetError("x"), Failure.BROKEN_RESPONSE),
        (UpstreamTimeout("x"), Failure.FIRST_BYTE_TIMEOUT),
        (UpstreamError("x"), Failure.BROKEN_RESPONSE),
    ],
)
def test_transport_failures_and_the_deadline(err: UpstreamError, failure: Failure) -> None:
    assert upstream_failure(err) is failure
    # The deadline while a transport failure is retried answers that failure (502);
    # while waiting for a timeout or a first answer, it is a timeout (504).
    expected = Failure.DEADLINE if isinstance(err, UpstreamTimeout) else failure
    assert deadline_failure(err) is expected
    assert deadline_failure(None) is Failure.DEADLINE
