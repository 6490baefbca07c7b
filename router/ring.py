"""A consistent-hash ring with virtual nodes, and the bounded-load walk on it.

Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam; HAProxy's
``hash-balance-factor``, Vimeo): a key goes to the first replica clockwise from its hash whose
load, counting the new request, stays within ``ceil(c * (total + 1) / n)``; otherwise the walk
continues clockwise, so an overloaded replica's keys spill to their *second* choice and keep some
locality there. Several gateways agree on placement without sharing state, because the ring and
the scraped load are all they need.

Example::

    ring = HashRing(["r0", "r1", "r2"], virtual_nodes=200)
    choice = bounded_choice(ring, key=stable_hash(b"conversation"), loads={"r0": 3, "r1": 0, "r2": 1})
    choice.target, choice.home, choice.walks
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

__all__ = [
    "BoundedChoice",
    "HashRing",
    "bounded_choice",
    "bounded_cost_choice",
    "load_bound",
    "stable_hash",
    "walk_to_fit",
]


def stable_hash(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (unlike ``hash()``, which is salted)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Replicas placed at ``virtual_nodes`` pseudo-random points each on a 64-bit circle."""

    def __init__(self, names: Iterable[str], virtual_nodes: int = 200) -> None:
        self.names = tuple(sorted(set(names)))
        points = [
            (stable_hash(f"{name}#{i}".encode()), name) for name in self.names for i in range(virtual_nodes)
        ]
        points.sort()
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]

    def owner(self, key: int) -> str | None:
        """The first replica clockwise from ``key``'s position (the first of :meth:`walk`)."""
        if not self._hashes:
            return None
        return self._owners[self._start(key)]

    def _start(self, key: int) -> int:
        # Fibonacci mixing spreads keys that are not already uniform (small ids in tests).
        position = (key * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        return bisect.bisect_left(self._hashes, position) % len(self._hashes)

    def walk(self, key: int) -> Iterator[str]:
        """Distinct replicas in clockwise order starting at ``key``'s position."""
        if not self._hashes:
            return
        n = len(self._hashes)
        start = self._start(key)
        seen: set[str] = set()
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.names):
                    return


@dataclass(frozen=True, slots=True)
class BoundedChoice:
    """``target`` -- where the key goes; ``home`` -- its first candidate on the ring;
    ``walks`` -- candidates skipped because they were over the bound."""

    target: str
    home: str
    walks: int


def walk_to_fit(
    ring: HashRing,
    key: int,
    is_candidate: Callable[[str], bool],
    fits: Callable[[str], bool],
    prefer: str | None = None,
) -> tuple[str | None, str | None, int]:
    """Walk the ring clockwise from ``key`` over the candidates (``prefer`` first, when it is one)
    and stop at the first that ``fits``: ``(target, home, walks)``, ``target`` ``None`` when none
    fits. ``home`` is the key's first candidate on the ring; ``walks`` counts those passed over.
    The walk visits only what it passes, so a decision costs what it walks, not the pool."""
    first = ring.owner(key)
    if first is not None and (prefer is None or prefer == first) and is_candidate(first) and fits(first):
        return first, first, 0  # the common case, without starting the walk
    walk = ring.walk(key)
    home = next(filter(is_candidate, walk), None)
    walks = 0
    if prefer is not None and prefer != home and is_candidate(prefer):
        if fits(prefer):
            return prefer, home, 0
        walks = 1
    if home is None:
        return None, None, walks
    if fits(home):  # the common case: the key's home, without building the rest of the walk
        return home, home, walks
    walks += 1
    for name in filter(is_candidate, walk):  # the same walk, on from home
        if name == prefer:
            continue
        if fits(name):
            return name, home, walks
        walks += 1
    return None, home, walks


def bounded_choice(
    ring: HashRing,
    key: int,
    loads: Mapping[str, float],
    balance_factor: float = 1.25,
) -> BoundedChoice | None:
    """Walk the ring from ``key`` over the replicas in ``loads`` (the candidates) and return the
    first whose load + 1 fits ``ceil(balance_factor * (total + 1) / n)``; if none fits (every
    candidate is at the bound, which the formula makes impossible for ``balance_factor >= 1``),
    the least loaded. Replicas on the ring but not in ``loads`` are skipped silently."""
    if not loads:
        return None
    bound = load_bound(sum(loads.values()), len(loads), balance_factor)
    target, home, walks = walk_to_fit(ring, key, loads.__contains__, lambda n: loads[n] + 1 <= bound)
    if target is None:
        target = min(loads, key=lambda r: loads[r])
    return BoundedChoice(target, home or target, walks)


def load_bound(total: float, n: int, balance_factor: float) -> int:
    """The most requests one of ``n`` replicas may hold, counting a new one: ``ceil(c (total + 1) / n)``."""
    return math.ceil(balance_factor * (total + 1) / n)


def bounded_cost_choice(
    ring: HashRing,
    key: int,
    costs: Mapping[str, float],
    balance_factor: float = 1.25,
    prefer: str | None = None,
) -> BoundedChoice | None:
    """The bounded-load walk with loads measured in work rather than requests.

    ``costs`` holds, per candidate, the work the request would find there *including its own*
    (e.g. prefill tokens queued ahead plus the request's tokens not cached there). The key stays
    on ``prefer`` (where its prefix was last sent) or else its first ring replica unless that
    cost exceeds ``balance_factor`` x the candidates' mean cost; then it walks clockwise. Counting
    the request's own work in every cost keeps an idle pool from walking (every cost equals the
    mean), and lets a replica that already holds most of the prompt take it even when busier.
    """
    if not costs:
        return None
    bound = balance_factor * sum(costs.values()) / len(costs)
    target, home, walks = walk_to_fit(ring, key, costs.__contains__, lambda n: costs[n] <= bound, prefer)
    if target is None:
        target = min(costs, key=lambda r: costs[r])
    return BoundedChoice(target, home or next(iter(costs)), walks)
