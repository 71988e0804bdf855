"""A circuit-breaking reverse-proxy sidecar for LLM APIs.

See ``README.md`` and the contract in ``shared/design/interface.md``.
"""

__version__ = "0.1.0"
