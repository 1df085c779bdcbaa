"""How many bytes of request bodies the webhook holds at once, and who may hold them.

The webhook does not authenticate its callers, so the budget must not be something a
client can take without paying for it (audit v2, N1: 22 header-only connections declaring
3 MiB each used to reserve all of it, and every honest admission got a 503):

- a request is charged for the bytes it has actually sent, chunk by chunk, never for
  what its Content-Length declares;
- one peer (source address) may hold at most `per_peer` bytes over all its requests;
- `reserve` bytes are kept for small bodies (a real pod review is a few KiB), and one
  peer may hold at most `per_peer_reserve` of them, so large senders, or one flooding
  address, cannot starve ordinary admissions.

How long a body may take to arrive (and so how long its bytes are held) is bounded by the
webhook (`body_deadline`), in proportion to its size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1024 * 1024


@dataclass(frozen=True)
class BudgetLimits:
    total: int = 64 * MIB  # bytes of bodies held at once, being read or being admitted
    reserve: int = 8 * MIB  # of total, kept for small bodies
    small_body: int = 64 * 1024  # a body up to this declared size may use the reserve
    per_peer: int = 6 * MIB  # one source address, outside the reserve
    per_peer_reserve: int = 1 * MIB  # one source address, inside the reserve
    # The body read deadline: base seconds plus one second per `rate` bytes declared
    # (an unknown length counts as the largest body accepted).
    deadline_base: float = 2.0
    deadline_rate: int = 1 * MIB


class BodyBudget:
    """The bytes held per pool and per peer. Single-threaded (the event loop's)."""

    def __init__(self, limits: BudgetLimits | None = None) -> None:
        self.limits = limits or BudgetLimits()
        self.shared_free = self.limits.total - self.limits.reserve
        self.reserve_free = self.limits.reserve
        self._shared_by_peer: dict[str, int] = {}
        self._reserve_by_peer: dict[str, int] = {}

    def body_deadline(self, declared: int) -> float:
        """Seconds a body of `declared` bytes may take to arrive."""
        return self.limits.deadline_base + declared / self.limits.deadline_rate

    def claim(self, peer: str, declared: int) -> BodyClaim:
        """A claim for one request's body; charge it as the bytes arrive, release it
        when the request is answered."""
        return BodyClaim(self, peer, declared <= self.limits.small_body)

    def _take(self, claim: BodyClaim, n: int) -> bool:
        held = self._shared_by_peer.get(claim.peer, 0)
        if n <= self.shared_free and held + n <= self.limits.per_peer:
            self.shared_free -= n
            self._shared_by_peer[claim.peer] = held + n
            claim.shared += n
            return True
        if not claim.small:
            return False
        held = self._reserve_by_peer.get(claim.peer, 0)
        if n <= self.reserve_free and held + n <= self.limits.per_peer_reserve:
            self.reserve_free -= n
            self._reserve_by_peer[claim.peer] = held + n
            claim.reserved += n
            return True
        return False

    def _give_back(self, claim: BodyClaim) -> None:
        for pool, n in ((self._shared_by_peer, claim.shared),
                        (self._reserve_by_peer, claim.reserved)):
            if n:
                left = pool[claim.peer] - n
                if left:
                    pool[claim.peer] = left
                else:
                    del pool[claim.peer]
        self.shared_free += claim.shared
        self.reserve_free += claim.reserved
        claim.shared = claim.reserved = 0

    def held_by(self, peer: str) -> int:
        return self._shared_by_peer.get(peer, 0) + self._reserve_by_peer.get(peer, 0)


@dataclass
class BodyClaim:
    budget: BodyBudget
    peer: str
    small: bool  # declared small enough to use the reserve
    shared: int = field(default=0)
    reserved: int = field(default=0)

    def charge(self, n: int) -> bool:
        """Hold n more bytes for this request; False when the budget refuses them."""
        return self.budget._take(self, n)

    def release(self) -> None:
        self.budget._give_back(self)
