"""OpenTelemetry traces (``[tracing]``; contract, "Traces"), see ``docs/tracing.md``.

This package's ``__init__`` and :mod:`sidecar.tracing.attributes` import nothing of
OpenTelemetry (the request path names the attempt reasons from there);
:mod:`sidecar.tracing.runtime` (the process's :class:`~sidecar.tracing.runtime.Tracing`),
:mod:`sidecar.tracing.spans` (one request's spans) and :mod:`sidecar.tracing.export`
(the batching, bounded and counted) do, and are imported only when the config has a
``[tracing]`` table.
"""
