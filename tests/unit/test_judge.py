"""sidecar.judge: context-window overflow, x-should-retry, rate_limited, slow calls (tables)."""

from __future__ import annotations

import pytest

from sidecar.breakers.machine import Verdict
from sidecar.errors import ErrorCode, error_body
from sidecar.judge import (
    CONTEXT_WINDOW_SCAN_BYTES,
    all_skipped_error,
    is_context_window_overflow,
    judge,
    no_retry_hint,
    slow_call_verdict,
)
from sidecar.sse_hold import Verdict as Said
from sidecar.testing import error_shapes

OPENAI_400 = error_shapes.openai_context_window_body()
ANTHROPIC_400 = error_shapes.anthropic_context_window_body()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (400, OPENAI_400, True),
        (400, ANTHROPIC_400, True),
        (413, ANTHROPIC_400, True),
        (400, b'{"error": {"code": "context_window_exceeded"}}', True),
        (400, b"This model's MAXIMUM CONTEXT LENGTH is 8192 tokens", True),  # vLLM, any case
        (400, b"Input exceeds the Context Window of this model", True),
        (400, b"Prompt Is Too Long", True),
        (413, b"request entity too large", False),
        (400, b'{"error": {"type": "invalid_request_error", "message": "bad tool"}}', False),
        (400, b"", False),
        (422, OPENAI_400, False),
        (429, ANTHROPIC_400, False),
        (500, b"context window", False),
        (200, OPENAI_400, False),
    ],
)
def test_context_window_overflow(status: int, body: bytes, expected: bool) -> None:
    assert is_context_window_overflow(status, body) is expected


def test_context_window_marker_only_in_the_first_64_kib() -> None:
    pad = b" " * (CONTEXT_WINDOW_SCAN_BYTES - len(b"context window"))
    assert is_context_window_overflow(400, pad + b"context window")
    assert not is_context_window_overflow(400, pad + b"!context window")


def test_context_window_marker_cut_by_the_limit_is_not_found() -> None:
    pad = b" " * (CONTEXT_WINDOW_SCAN_BYTES - 4)
    assert not is_context_window_overflow(400, pad + b"context window")


UNAVAILABLE, TIMEOUT = ErrorCode.UPSTREAM_UNAVAILABLE, ErrorCode.UPSTREAM_TIMEOUT
OPEN, LIMITED = ErrorCode.CIRCUIT_OPEN, ErrorCode.RATE_LIMITED


@pytest.mark.parametrize(
    ("own_error", "failing_status", "retried", "expected"),
    [
        # the sidecar's own errors: futile or already done
        (UNAVAILABLE, False, False, True),
        (UNAVAILABLE, False, True, True),
        (TIMEOUT, False, False, True),
        (OPEN, False, False, True),
        (LIMITED, False, False, True),
        # ...but not its own cap, nor the request's own faults
        (ErrorCode.OVERLOADED, False, False, False),
        (ErrorCode.OVERLOADED, True, True, False),
        (ErrorCode.NO_ROUTE, False, False, False),
        (ErrorCode.REQUEST_TOO_LARGE, False, False, False),
        (ErrorCode.BAD_REQUEST, False, False, False),
        # relayed answers: a failing status after a retry or a fallback only
        (None, True, True, True),
        (None, True, False, False),
        (None, False, True, False),  # a success or a caller answer after a fallback
        (None, False, False, False),
    ],
)
def test_no_retry_hint(
    own_error: ErrorCode | None, failing_status: bool, retried: bool, expected: bool
) -> None:
    got = no_retry_hint(
        enabled=True,
        own_error=own_error,
        failing_status=failing_status,
        retried_or_fell_back=retried,
    )
    assert got is expected
    off = no_retry_hint(
        enabled=False,
        own_error=own_error,
        failing_status=failing_status,
        retried_or_fell_back=retried,
    )
    assert off is False


@pytest.mark.parametrize(
    ("last_failures", "expected"),
    [
        (["http_429"], LIMITED),
        (["http_429", "http_429"], LIMITED),
        (["http_429", "http_503"], OPEN),
        (["connect_error", "http_429"], OPEN),
        ([None], OPEN),
        (["http_429", None], OPEN),
        (["sse_error"], OPEN),
        (["slow_call"], OPEN),
        ([], OPEN),
    ],
)
def test_all_skipped_error(last_failures: list[str | None], expected: ErrorCode) -> None:
    assert all_skipped_error(iter(last_failures)) is expected


def test_rate_limited_answer_in_both_shapes() -> None:
    assert ErrorCode.RATE_LIMITED.status == 429
    assert ErrorCode.RATE_LIMITED.code == "rate_limited"
    openai_shape = error_body(ErrorCode.RATE_LIMITED, "/v1/chat/completions")
    assert openai_shape.startswith(b'{"error":{"message":')
    assert openai_shape.endswith(b'"type":"rate_limited","code":"rate_limited"}}')
    anthropic_shape = error_body(ErrorCode.RATE_LIMITED, "/v1/messages")
    assert anthropic_shape.startswith(b'{"type":"error","error":{"type":"rate_limit_error",')


S, F, N = Verdict.SUCCESS, Verdict.FAILURE, Verdict.NEUTRAL


@pytest.mark.parametrize(
    ("verdict", "first_output_s", "slow_call_ms", "expected"),
    [
        (S, 40.0, 0, S),  # off
        (S, 40.0, 2000, F),
        (S, 2.0, 2000, S),  # exactly the limit is not slower than it
        (S, 2.0001, 2000, F),
        (S, 0.001, 1, S),
        (S, 0.0011, 1, F),
        (F, 40.0, 2000, F),
        (N, 40.0, 2000, N),  # a neutral answer stays neutral, however slow
        (N, 0.1, 2000, N),
    ],
)
def test_slow_call_verdict(
    verdict: Verdict, first_output_s: float, slow_call_ms: int, expected: Verdict
) -> None:
    assert slow_call_verdict(verdict, first_output_s, slow_call_ms) is expected


# -- the judge step: one answer at its commit point ---------------------------------------

RETRY, FAIL = frozenset({429, 503}), frozenset({429, 503})
S, N, F = Verdict.SUCCESS, Verdict.NEUTRAL, Verdict.FAILURE
CW_BODY = error_shapes.openai_context_window_body()


@pytest.mark.parametrize(
    ("status", "first", "said", "cw", "slow_ms", "took", "expected"),
    [
        # (verdict, outcome, retried, moves_on, last_failure, slow)
        (200, b"x", None, True, 0, 9.0, (S, "success", False, False, None, False)),
        (200, b"", None, True, 0, 0.1, (N, "empty", False, False, None, False)),
        (503, None, None, True, 0, 0.1, (F, "http_5xx", True, True, "http_503", False)),
        (400, b"{}", None, True, 0, 0.1, (N, "http_4xx", False, False, None, False)),
        (400, CW_BODY, None, True, 0, 0.1, (N, "http_4xx", False, True, None, False)),
        (400, CW_BODY, None, False, 0, 0.1, (N, "http_4xx", False, False, None, False)),
        (200, b"e", Said.PROVIDER_ERROR, True, 0, 0.1,
         (F, "sse_error", True, True, "sse_error", False)),
        (200, b"e", Said.CALLER_ERROR, True, 0, 0.1,
         (N, "http_4xx", False, False, None, False)),
        (200, b"x", Said.COMMIT, True, 2000, 2.5,
         (F, "success", False, False, "slow_call", True)),
        (200, b"x", Said.COMMIT, True, 2000, 1.5,
         (S, "success", False, False, None, False)),
    ],
)  # fmt: skip
def test_the_judge_step(
    status: int,
    first: bytes | None,
    said: Said | None,
    cw: bool,
    slow_ms: int,
    took: float,
    expected: tuple[object, ...],
) -> None:
    j = judge(status, first, said, RETRY, FAIL, cw, slow_ms, took)
    got = (j.verdict, j.outcome.value, j.retried, j.moves_on, j.last_failure, j.slow)
    assert got == expected


@pytest.mark.parametrize(
    ("said", "enabled", "probe", "expected"),
    [
        (Said.EMPTY, True, False, (F, "empty_turn", True, True, "empty_turn", "empty_turn")),
        (Said.EMPTY, True, True, (N, "empty_turn", True, True, "empty_turn", "empty_turn")),
        (Said.EMPTY, False, False, (S, "success", False, False, None, "failure")),
        (Said.COMMIT, True, True, (S, "success", False, False, None, "failure")),
    ],
)
def test_an_empty_turn(
    said: Said, enabled: bool, probe: bool, expected: tuple[object, ...]
) -> None:
    """Contract, "An empty turn is a failure": with empty_turn_is_failure, a failure
    that moves on (retried once by the loop), neutral on a half-open probe; without
    it, the answer is a success like any other."""
    j = judge(200, b"data: [DONE]\n\n", said, RETRY, FAIL, True, 0, 0.1, enabled, probe)
    got = (j.verdict, j.outcome.value, j.retried, j.moves_on, j.last_failure, j.why)
    assert got == expected


def test_a_context_window_overflow_moves_on_with_its_own_reason() -> None:
    j = judge(400, CW_BODY, None, RETRY, FAIL, True, 0, 0.1)
    assert (j.moves_on, j.why) == (True, "context_window")


@pytest.mark.parametrize(
    ("status", "said", "failure_statuses", "expected"),
    [
        # (verdict, last_failure, rate_limit)
        (429, None, FAIL, (F, "http_429", True)),
        (429, None, frozenset({503}), (N, None, False)),  # not a failure: nothing to count
        (503, None, FAIL, (F, "http_503", False)),
        (200, Said.RATE_LIMIT_ERROR, FAIL, (F, "sse_error", True)),
        (200, Said.PROVIDER_ERROR, FAIL, (F, "sse_error", False)),
        (200, Said.COMMIT, FAIL, (S, None, False)),
    ],
)
def test_a_rate_limit_is_told_apart(
    status: int, said: Said | None, failure_statuses: frozenset[int], expected: tuple[object, ...]
) -> None:
    """Contract, "Bounding the load that failures add": a 429 (when it is a failure) and a
    rate_limit_error / rate_limit_exceeded error event are rate limits (for
    rate_limit_scope); any other failure is not."""
    j = judge(status, b"x" if said else None, said, RETRY, failure_statuses, False, 0, 0.1)
    assert (j.verdict, j.last_failure, j.rate_limit) == expected
