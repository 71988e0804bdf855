"""The circuit breakers: one per target, pure rules apart from their IO.

- :mod:`~sidecar.breakers.types`: the shapes (settings, state, permit, transition);
- :mod:`~sidecar.breakers.machine`: the state machine of every target (pure: no
  clock reads, no asyncio), with the consecutive, failure-rate and ramp rules;
- :mod:`~sidecar.breakers.window`: the failure-rate window of one target (pure);
- :mod:`~sidecar.breakers.live`: the machine with its timer, logs and metrics, the
  breakers a generation uses without the fleet;
- :mod:`~sidecar.breakers.port`: the interface the request path asks, which the
  local breakers and the fleet's (:mod:`sidecar.fleet.breakers`) both provide.

Rules: ``docs/interface.md``, "The circuit breaker" and "Choosing among candidates".
"""
