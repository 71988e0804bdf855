"""The demo's script: the sidecar's config and what the primary does when."""

from __future__ import annotations

from sidecar.demo.report import Phase
from sidecar.testing import Fault

__all__ = ["FALLBACK_OK", "LOOPBACK", "PRIMARY_OK", "SETTINGS", "demo_config", "phases"]

LOOPBACK = "127.0.0.1:0"

PRIMARY_OK = Fault(chunks=6, delay_first_chunk_ms=30, chunk_delay_ms=8)
FALLBACK_OK = Fault(chunks=6, delay_first_chunk_ms=60, chunk_delay_ms=8)

SETTINGS = {
    "max_retries": 2,
    "backoff_initial_ms": 50,
    "failure_threshold": 3,
    "cooldown_ms": 3000,
    "first_byte_timeout_ms": 800,
}


def demo_config(primary: str, fallback: str, *, breaker: bool) -> str:
    """The sidecar's TOML for the demo (``breaker=False``: the twin's)."""
    s = SETTINGS
    cb = f"""
[upstreams.primary.circuit_breaker]
failure_threshold = {s["failure_threshold"]}
cooldown_ms = {s["cooldown_ms"]}
half_open_max_probes = 1
"""
    return f"""
[server]
listen = "{LOOPBACK}"
admin_listen = "{LOOPBACK}"
request_timeout_ms = 10000
drain_timeout_ms = 2000

[upstreams.primary]
base_url = "{primary}"
first_byte_timeout_ms = {s["first_byte_timeout_ms"]}

[upstreams.primary.retry]
max_retries = {s["max_retries"]}
backoff_initial_ms = {s["backoff_initial_ms"]}
backoff_max_ms = 400
{cb if breaker else ""}
[upstreams.fallback]
base_url = "{fallback}"

[[routes]]
name = "v1"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary" }}, {{ upstream = "fallback" }}]
"""


def phases(seconds: float) -> list[Phase]:
    """The primary's script: healthy, 503s, hanging, recovered (at fixed fractions)."""

    def at(fraction: float) -> float:
        return round(seconds * fraction * 2) / 2

    timeout_s = SETTINGS["first_byte_timeout_ms"] / 1000
    return [
        Phase(
            at(0.25),
            "503",
            "answers 503",
            Fault(status=503),
            "primary starts failing: it answers 503",
        ),
        Phase(
            at(0.45),
            "hang",
            "hangs",
            Fault(stall=True),
            f"primary now hangs: no reply (first-byte timeout {timeout_s:g} s)",
        ),
        Phase(at(0.60), "ok", "recovers", PRIMARY_OK, "primary recovered: it answers 200 again"),
    ]
