"""A front door's admission count: the requests it has taken and not yet finished, exactly.

Each admitted request takes one slot and gives it back when its HTTP request ends, through
``request_end`` (the ASGI call's ``finally``), whatever way it ends: finished, failed, timed out, or the
client gone before or after the first byte. The count gates admission against ``max_ongoing_requests +
max_queued_requests`` (past it, a 429), feeds the autoscaling signal and ``/strata/stats``; counted in a
streaming generator's ``finally`` it used to leak a slot whenever a client left at the wrong moment.
"""

from __future__ import annotations

from strata.deployments.openai.request_end import at_request_end


class Admission:
    """Slots of one front door (one instance per replica; the event loop's thread only)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def admit(self) -> bool:
        """Take a slot for the current HTTP request until it ends; False when every slot is taken."""
        if self.held >= self.limit:
            return False
        if not at_request_end(self._release):
            raise RuntimeError("admission needs RequestEndMiddleware around the app")
        self.held += 1
        return True

    def _release(self) -> None:
        self.held -= 1
