"""The wire: everything the sidecar takes from aiohttp's insides, behind one door.

To cost no more CPU than a bare aiohttp relay, the request path skips some of
aiohttp's general machinery and reproduces or overrides a few of its private steps.
All of that lives in this package, and only here; the policy modules (the proxy
page, the judge, the breakers, the relay's rules) call the plain functions and
classes below and never touch an aiohttp private name. What each module does:

- :mod:`~sidecar.wire.upstream_call`: one upstream exchange on aiohttp's own client
  objects without ``ClientSession._request``;
- :mod:`~sidecar.wire.upstream_request`: aiohttp's request class without its
  per-request header rebuild and with the body inlined in the head's write; for an
  upstream behind an egress proxy, a subclass bound to that proxy (aiohttp's own
  ``CONNECT`` path in its connector does the tunnel);
- :mod:`~sidecar.wire.pool`: the connection pool's hooks (reuse, the wait for a free
  connection, an idle pooled connection that receives bytes is closed) and the
  upstream protocol (a reset before the body's end is a cut; the push pump's hook; a
  complete answer followed by stray bytes in the same read is kept);
- :mod:`~sidecar.wire.push_pump`: a committed chunked stream pushed to the client
  from the upstream connection's data callback; :func:`send_rest` picks it;
- :mod:`~sidecar.wire.whole_answer`: a whole answer in one write, and whether an
  answer can only end at the connection's close; a refusal sent as ``HTTP/1.1`` whatever
  the request's version;
- :mod:`~sidecar.wire.downstream`: the proxy port's low-level server and its
  connections (the request-head deadline), and the ``100 Continue`` write.

Every private name relied on, by the aiohttp object it belongs to (each is pinned
by a test that fails by name when an aiohttp release changes it:
``tests/unit/test_pool.py``, ``test_push_pump.py``, ``test_whole_answer.py``,
``test_upstream_call.py``, ``test_upstream_request.py``, ``test_downstream.py``):

=====================================  ==============================================
aiohttp object                         private names
=====================================  ==============================================
``ClientSession``                      ``_request_class``, ``_response_class``,
                                       ``_loop``, ``_read_bufsize``,
                                       ``_max_line_size``, ``_max_field_size``,
                                       ``_max_headers`` (upstream_call)
``TCPConnector``                       ``_get``, ``_release``, ``_acquired``,
                                       ``_wait_for_available_connection``,
                                       ``_factory``, ``_loop``,
                                       ``_timeout_ceil_threshold`` (pool,
                                       upstream_call); ``Connection``'s
                                       ``_connector`` (upstream_request)
``client_proto.ResponseHandler``       the module itself, ``data_received``,
                                       ``set_response_params`` (its parser limits),
                                       ``_payload``, ``_reading_paused`` (pool,
                                       push_pump); ``set_exception`` (its cause),
                                       ``_skip_payload``, ``_read_bufsize``,
                                       ``_should_close`` (pool: an answer followed
                                       by stray bytes)
``ClientRequest``                      ``_body``, ``_continue``, ``_traces``, ``_timer``,
                                       ``_upload_tracker``, ``_session``,
                                       ``_skip_auto_headers``,
                                       ``_get_content_length``, ``write_bytes``
                                       (upstream_request); ``update_proxy`` called
                                       by its ``__init__`` (``proxied_request_class``:
                                       the connector's own ``CONNECT`` path then
                                       runs, ``_create_proxy_connection``)
``StreamReader``                       ``_low_water`` (push_pump)
``web.StreamResponse``                 ``_keep_alive``, ``_eof_sent``,
                                       ``_body_length``; ``_prepare_headers``,
                                       ``_write_headers``, ``_req``,
                                       ``_payload_writer`` (``RelayedAnswer``)
                                       (whole_answer)
``http.StreamWriter``                  ``chunked``, ``length``, ``output_size``
                                       (push_pump, whole_answer, downstream);
                                       ``_headers_buf``, ``_headers_written``
                                       (the buffered head ``raw_head``
                                       replaces: whole_answer, upstream_request)
``web_protocol.RequestHandler``        the module itself, ``handle_error`` (its
                                       ``status`` and ``exc``); the parsers'
                                       ``LineTooLong`` and "Too many headers
                                       received" (downstream)
``helpers``                            ``TimerNoop``, ``must_be_empty_body``,
                                       ``rfc822_formatted_time``, ``_EXC_SENTINEL``
``http``                               ``SERVER_SOFTWARE``
=====================================  ==============================================

Tested on aiohttp 3.14.4 and 3.14.5, the range ``pyproject.toml`` declares
(``>=3.14.4,<3.15``): 3.14.0 to 3.14.3 lack ``ClientRequest._upload_tracker`` and
prepare ``Date`` otherwise, 3.13.x also lacks ``ClientSession._max_headers``.
``.ci/run`` runs the pin tests and a smoke set on the lowest and the highest version
of that range besides the full suite; raise its ``AIOHTTP_HIGH`` with each new 3.14.x.
"""

from sidecar.wire.downstream import DownstreamConnection, ProxyServer, send_continue, wide_head
from sidecar.wire.pool import PoolConnector, PoolWatcher, UpstreamProtocol
from sidecar.wire.push_pump import PushPump, send_rest
from sidecar.wire.upstream_call import ResponseCutError, UpstreamResponse, call
from sidecar.wire.upstream_request import (
    SKIP_AUTO_HEADERS,
    UpstreamRequest,
    proxied_request_class,
)
from sidecar.wire.whole_answer import (
    RelayedAnswer,
    ends_at_close,
    send_closing,
    send_whole,
    sendable_whole,
)

__all__ = [
    "SKIP_AUTO_HEADERS",
    "DownstreamConnection",
    "PoolConnector",
    "PoolWatcher",
    "ProxyServer",
    "PushPump",
    "RelayedAnswer",
    "ResponseCutError",
    "UpstreamProtocol",
    "UpstreamRequest",
    "UpstreamResponse",
    "call",
    "ends_at_close",
    "proxied_request_class",
    "send_closing",
    "send_continue",
    "send_rest",
    "send_whole",
    "sendable_whole",
    "wide_head",
]
