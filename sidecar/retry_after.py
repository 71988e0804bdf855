"""``Retry-After`` parsing (pure).

RFC 9110 section 10.2.3: the value is either delay-seconds (a non-negative
integer) or an HTTP-date. Providers (OpenAI, Anthropic) send delay-seconds;
dates are accepted too. Fractional seconds are accepted as a leniency.
"""

from __future__ import annotations

from email.utils import parsedate_to_datetime


def parse_retry_after(value: str | None, now_unix: float) -> float | None:
    """Seconds to wait asked by a ``Retry-After`` header value.

    :param value: the raw header value, or None.
    :param now_unix: current Unix time in seconds (for HTTP-date values).
    :returns: seconds >= 0, or None when absent or unparseable.
    """
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        return max(0.0, when.timestamp() - now_unix)
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return None
    return seconds
