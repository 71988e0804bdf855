"""The two aiohttp internals sidecar.wire.pool overrides still exist with the shape it expects.

``PoolConnector`` replaces aiohttp's tracing for two contract rules (the keep-alive
resend, and pool waits not charged to the first-byte timeout); when an aiohttp
release renames or reshapes these steps, this fails by name instead of the rules
silently going away. The rules themselves are tested end to end in tests/e2e.
"""

from __future__ import annotations

import inspect

import aiohttp
import pytest
from aiohttp.client_proto import ResponseHandler

from sidecar.wire.pool import PoolConnector, complete_answer_end


@pytest.mark.parametrize("name", ["_get", "_wait_for_available_connection"])
def test_overridden_connector_steps_exist(name: str) -> None:
    base = getattr(aiohttp.TCPConnector, name)
    assert inspect.iscoroutinefunction(base), f"aiohttp's {name} is no longer a coroutine"
    assert list(inspect.signature(base).parameters) == ["self", "key", "traces"]
    assert getattr(PoolConnector, name) is not base  # ours is the one called


def test_connect_still_goes_through_them() -> None:
    source = inspect.getsource(aiohttp.BaseConnector.connect)
    assert "self._get(key, traces)" in source
    assert "self._wait_for_available_connection(key, traces)" in source


def test_the_connector_still_builds_its_protocols_with_factory() -> None:
    # PoolConnector sets aiohttp's private `_factory` to UpstreamProtocol (the resend-once
    # rule needs to know whether any response byte arrived); fail by name if it moves.
    source = inspect.getsource(aiohttp.BaseConnector.__init__)
    assert "self._factory = functools.partial(ResponseHandler, loop=loop)" in source
    assert "self._factory" in inspect.getsource(aiohttp.TCPConnector._create_direct_connection)


def test_full_reads_the_connectors_acquired_set() -> None:
    # PoolConnector.full (a tier member whose connections are all busy is not picked)
    # counts aiohttp's private `_acquired`, as aiohttp's own count of free connections
    # does. Fail by name if it moves.
    source = inspect.getsource(aiohttp.BaseConnector)
    assert "self._limit - len(self._acquired)" in source
    assert "self._acquired.add(proto)" in inspect.getsource(aiohttp.BaseConnector.connect)


@pytest.mark.timeout(10)
async def test_full_is_true_while_every_connection_is_in_use() -> None:
    connector = PoolConnector(limit=2)
    try:
        assert connector.full is False
        fake = [object(), object()]
        connector._acquired.update(fake)  # type: ignore[arg-type]
        assert connector.full is True
        connector._acquired.discard(fake[0])
        assert connector.full is False
        connector._acquired.clear()
    finally:
        await connector.close()
    assert PoolConnector(limit=0).full is False


def test_a_parser_failure_still_reaches_set_exception_with_its_cause() -> None:
    """``UpstreamProtocol.set_exception`` recovers a complete answer followed by stray
    bytes: aiohttp's ``data_received`` must still hand the parser's own exception as the
    cause, and ``set_response_params`` still make a new parser from these settings."""
    source = inspect.getsource(ResponseHandler.data_received)
    assert "self.set_exception(exc, underlying_exc)" in source
    params = inspect.signature(ResponseHandler.set_response_params).parameters
    for name in (
        "timer", "skip_payload", "read_until_eof", "auto_decompress", "read_timeout",
        "read_bufsize", "timeout_ceil_threshold", "max_line_size", "max_field_size",
        "max_headers",
    ):  # fmt: skip
        assert name in params, name
    source = inspect.getsource(ResponseHandler.set_response_params)
    for step in ("self._skip_payload = skip_payload", "self._read_bufsize = read_bufsize"):
        assert step in source, step
    assert "self._should_close = True" in inspect.getsource(ResponseHandler.set_exception)
    assert list(inspect.signature(ResponseHandler.set_exception).parameters) == [
        "self", "exc", "exc_cause",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "bodiless", "end"),
    [
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello", False, 46),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA", False, 40),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nHEAD", True, 39),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", False, None),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nokX", False, None),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX", False, None),
        (b"HTTP/1.1 100 Continue\r\n\r\nX", False, None),
        (b"HTTP/1.1 200 OK\r\nContent-Len", False, None),
    ],
)
def test_complete_answer_end(data: bytes, bodiless: bool, end: int | None) -> None:
    assert complete_answer_end(data, bodiless) == end
    if end is not None:
        assert data[:end].endswith(b"\r\n\r\n" if bodiless or b" 204 " in data else b"ok")
