"""What a generation's breakers offer the proxy, ``/status`` and a reload: one interface.

:class:`BreakerPort` is satisfied by :class:`sidecar.breakers.live.LiveBreakers` (this
member's own breakers) and, with ``[fleet]``, by
:class:`sidecar.fleet.breakers.FleetBreakers`, which holds a ``LiveBreakers`` and adds
the fleet's decisions. Without ``[fleet]`` the proxy calls ``LiveBreakers`` itself: no
layer in between.

Every method but :meth:`BreakerPort.lease` runs synchronously between awaits.
Times are read from the injected clock by the implementation; durations are seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, TypeGuard

from sidecar.breakers.credentials import CredentialBreakers
from sidecar.breakers.types import BreakerState, Permit, Target, Transition, Verdict


class BreakerPort(Protocol):
    """A generation's breakers, as the request path, ``/status`` and a reload use them.

    The request path, per candidate call: :meth:`admit`; while :attr:`credentials`
    holds any breaker, :meth:`admit_credential`; if :meth:`lease_needed`,
    ``await`` :meth:`lease`; :meth:`may_continue` before each retry; then settle the
    permit once, with :meth:`record` or :meth:`release`. No method raises on an
    unknown target: it has no breaker and is always admitted.
    """

    def admit(self, target: Target) -> Permit | None:
        """A permit to call ``target`` now, or None to skip it (counted as a rejection)."""
        ...

    credentials: CredentialBreakers
    """The breakers of (target, credential) (``rate_limit_scope = "credential"``): this
    member's own, never shared with the fleet. The request path reads
    ``credentials.held`` (0: none kept, nothing to ask) before :meth:`admit_credential`."""

    def admit_credential(self, permit: Permit, headers: Mapping[str, str]) -> Permit | None:
        """``permit`` once the breaker of (its target, the request's credential, read from
        ``headers``) admits the call too, or None to skip the target for this request
        (``permit`` is then settled)."""
        ...

    def credential_skip(self, target: Target, headers: Mapping[str, str]) -> tuple[bool, float]:
        """Whether the request's credential breaker on ``target`` refuses calls now, and
        the seconds until it admits one (for the answer when every candidate was skipped)."""
        ...

    def lease_needed(self, permit: Permit | None) -> TypeGuard[Permit]:
        """Whether ``permit`` must first take the fleet's probe lease (:meth:`lease`)."""
        ...

    async def lease(self, permit: Permit) -> Permit | None:
        """Take the fleet's probe lease for ``permit`` (waits at most 250 ms): the permit
        to go on with, or None to skip the target (the permit is then settled).

        :raises asyncio.CancelledError: the caller was cancelled (the permit is settled).
        """
        ...

    def may_continue(self, permit: Permit) -> bool:
        """Whether a call holding ``permit`` may retry (its breaker has not moved since)."""
        ...

    def record(
        self,
        permit: Permit,
        verdict: Verdict,
        *,
        last_failure: str | None = None,
        retry_after_s: float | None = None,
        rate_limit: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> Sequence[Transition]:
        """Settle ``permit`` with ``verdict`` (once per candidate call); ``retry_after_s``
        is the failing answer's capped Retry-After. A ``rate_limit`` FAILURE on a target
        with ``rate_limit_scope = "credential"`` counts against the breaker of (target,
        the credential in ``headers``) and is neutral for the target. Returns the moves
        this member's own target breaker made (already logged and counted)."""
        ...

    def release(self, permit: Permit) -> None:
        """Settle ``permit`` with no verdict (cancellation, unexpected error)."""
        ...

    def note_retry_after(self, target: Target, retry_after_s: float) -> None:
        """A failing answer asked for ``retry_after_s`` seconds: may extend an open breaker."""
        ...

    def last_failure(self, target: Target) -> str | None:
        """The ``last_failure`` of ``target``'s breaker (None: none, or no breaker)."""
        ...

    def retry_in(self, targets: Iterable[Target]) -> float | None:
        """Seconds until the soonest of ``targets`` allows a call (None: unknown)."""
        ...

    def status(self, all_targets: bool) -> list[dict[str, object]]:
        """``/status`` entries: open and half-open targets, every one if ``all_targets``."""
        ...

    def ramping(self, target: Target) -> bool:
        """Whether ``target`` is in its paced recovery (``ramp_ms``): a skip of it is then
        a ramp skip (fallback reason ``ramp``), not an open breaker's."""
        ...

    def states(self) -> list[tuple[Target, BreakerState]]:
        """A snapshot of this member's own breakers (what a reload carries over)."""
        ...

    def set_override(self, target: Target, action: str, reason: str, for_ms: int | None) -> bool:
        """An operator's override from this member's admin port (``action``:
        ``force_open``, ``force_closed`` or ``auto``; ``for_ms``: its end, milliseconds
        from now, None for none): applied, logged and counted; with the fleet on, shared
        with every member. False when ``target`` has no breaker."""
        ...

    def close(self) -> None:
        """Stop the timer and go quiet (shutdown, or replaced by a reload)."""
        ...
