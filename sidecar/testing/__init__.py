"""Test doubles: a fault-injecting fake LLM upstream, sockets that fail on purpose, a fake clock.

Public API::

    from sidecar.testing import FakeUpstream, Fault, closed_port, saturated_listener

    async with FakeUpstream() as fake:
        fake.script([Fault(status=503, retry_after="1"), Fault(reset_after_chunks=2)])
        ...  # point a client (or the sidecar) at fake.url
        assert fake.request_count == 2

See :class:`FakeUpstream` for routes, fault selection and accounting, and
:class:`Fault` for every behaviour. ``python -m sidecar.testing --port 8001``
serves one by hand.
"""

from . import error_shapes, turn_shapes
from .clock import FakeClock
from .fake_upstream import DEFAULT_MODELS, FAULT_FOR_HEADER, FAULT_HEADER, FakeUpstream
from .fault import WIRE_FIELDS, Fault, ReceivedRequest, fault_from_json
from .net import closed_port, saturated_listener

__all__ = [
    "DEFAULT_MODELS",
    "FAULT_FOR_HEADER",
    "FAULT_HEADER",
    "WIRE_FIELDS",
    "FakeClock",
    "FakeUpstream",
    "Fault",
    "ReceivedRequest",
    "closed_port",
    "error_shapes",
    "fault_from_json",
    "saturated_listener",
    "turn_shapes",
]
