"""``sidecar demo``: fake providers, the real sidecar and a traffic driver, on loopback.

Modules: :mod:`~sidecar.demo.run` (the show), :mod:`~sidecar.demo.script` (the config
and the primary's faults), :mod:`~sidecar.demo.traffic` (the driver),
:mod:`~sidecar.demo.show` and :mod:`~sidecar.demo.report` (the screen and summary).
"""

from sidecar.demo.run import run_demo

__all__ = ["run_demo"]
