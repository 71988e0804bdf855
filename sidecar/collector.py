"""The garbage collector's settings for ``sidecar serve``, a long-running server process.

CPython collects its youngest generation whenever the number of container objects
alive has grown by ``gc.get_threshold()[0]`` (700 by default) since the last
collection: allocations count up, frees count down. A proxy at 64 concurrent
requests holds more than 700 such objects in its requests in flight alone, so the
default threshold starts a collection every few requests that traverses them all
and frees nothing; every tenth of those traverses the older generation too, and
about once a second a full collection walks every object the process has,
startup's modules, config and routes included (15 ms each). Measured on
``benchmarks/overhead.py``'s JSON workload at concurrency 64: 13 us of collector
time per request, 5% of the sidecar's CPU (``benchmarks/results/profile.md``).

:func:`tune_for_serving` changes two things, once the servers listen:

* what startup built is collected once, then frozen (:func:`gc.freeze`): full
  collections no longer walk it (they took 15 ms, now about 1 ms);
* the young generation's threshold goes to :data:`YOUNG_THRESHOLD`, above what
  requests in flight hold, so a collection runs when garbage cycles have piled
  up rather than whenever load rises. Objects freed by reference counting (nearly
  all of a request's) are freed as before; only reference cycles wait longer, at
  most that many objects more.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Container objects alive beyond the last collection that start the next one (CPython: 700)."""


def tune_for_serving() -> None:
    """Collect and freeze startup's objects, then raise the young generation's threshold.

    Call once per process, after startup (``sidecar serve`` does, after its
    servers listen); the older generations keep CPython's thresholds.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
