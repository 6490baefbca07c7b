"""An LRU of block keys that costs the garbage collector nothing to walk.

A replica's prefix index can hold its whole KV cache in blocks -- tens of thousands of keys per
replica, millions over a large pool. In an ``OrderedDict`` (a container the collector tracks)
every full collection visits every key, which paused the gateway for half a second at 2,048
replicas. :class:`BlockLRU` keeps the same order in structures the collector never visits: a
plain ``dict`` of int keys and float times (CPython stops tracking a dict that holds only such
values; a touch removes and re-inserts its keys at C speed, so the dict is in LRU order) and a
log of touches in two ``array`` buffers. A touch appends to the log; an eviction pops the log's
head and drops the key only if that entry is its latest touch (a key touched again has a later
entry), without the scan past deleted slots that taking a dict's first key would cost; it judges
a stretch of the log at a time with ``map`` and ``compress``, at C speed. When
stale entries outnumber live ones the log is rebuilt from the dict: a copy, not a sort, so it
costs about a millisecond at a replica's full KV size.

Keys are unsigned 64-bit integers (the chained block hashes of :mod:`router.prefix`).

Example::

    lru = BlockLRU()
    lru.touch([b2, b1, b0], now)       # b0 is now the most recent
    gone = lru.evict_to(capacity)       # the least recently used keys beyond capacity
    lru.oldest()                        # when the least recently used key was last touched
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from operator import eq

__all__ = ["BlockLRU"]

_COMPACT_MIN = 4096  # log entries before a compaction is considered


class BlockLRU:
    __slots__ = ("_head", "_keys", "_last", "_t", "_times")

    def __init__(self) -> None:
        self._last: dict[int, float] = {}  # key -> time of its latest touch
        self._keys = array("Q")  # the touch log, oldest first, from _head on
        self._times = array("d")
        self._head = 0
        self._t = -math.inf  # the latest touch time (strictly increasing per touch call)

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: object) -> bool:
        return key in self._last

    @property
    def held(self) -> Mapping[int, float]:
        """Key -> time of its latest touch (read-only use)."""
        return self._last

    def touch(self, keys: Sequence[int], now: float) -> None:
        """Mark ``keys`` used at ``now``, in order (the last one becomes the most recent)."""
        # One float object shared by every key of this touch; strictly after the previous touch,
        # so a key's latest log entry is the one whose time equals its own.
        t = now if now > self._t else math.nextafter(self._t, math.inf)
        self._t = t
        last = self._last
        # Out and back in, in order, at C speed (one key at a time: ``dict.update`` of many keys
        # resizes the dict first whenever its free slots are fewer, and popped keys leave none).
        deque(map(last.pop, keys, repeat(None)), maxlen=0)
        deque(map(last.__setitem__, keys, repeat(t)), maxlen=0)
        self._keys.extend(keys)
        self._times.extend(array("d", (t,)) * len(keys))
        if len(self._keys) - self._head > 2 * len(last) + _COMPACT_MIN:
            self._compact()

    def evict_to(self, capacity: int) -> list[int]:
        """Drop the least recently used keys until at most ``capacity`` remain; returns them."""
        last = self._last
        if len(last) <= capacity:
            return []
        keys, times, h = self._keys, self._times, self._head
        gone: list[int] = []
        while len(last) > capacity:
            # A stretch of the log from its head, judged at C speed: an entry is live when it is
            # its key's latest touch (a key touched again has a later entry; a gone key has none).
            excess = len(last) - capacity
            end = min(len(keys), h + 2 * excess + 16)
            live = list(compress(range(h, end), map(eq, map(last.get, keys[h:end]), times[h:end])))
            if len(live) > excess:
                del live[excess:]
                end = live[-1] + 1
            # (a key listed twice in one touch has two live entries: counted once)
            batch = list(dict.fromkeys(map(keys.__getitem__, live)))
            deque(map(last.__delitem__, batch), maxlen=0)
            gone += batch
            h = end
        self._head = h
        if h > _COMPACT_MIN and 2 * h > len(keys):
            del keys[:h]
            del times[:h]
            self._head = 0
        return gone

    def oldest(self) -> float | None:
        """When the least recently used key was last touched; ``None`` when empty."""
        last = self._last
        if not last:
            return None
        keys, times, h = self._keys, self._times, self._head
        while last.get(keys[h]) != times[h]:  # stale entries at the head: drop them
            h += 1
        self._head = h
        return times[h]

    def _compact(self) -> None:
        """Rewrite the log with only each key's latest entry: the dict's own order, which touches
        keep in LRU order (a copy at C speed)."""
        last = self._last
        self._keys = array("Q", last)
        self._times = array("d", last.values())
        self._head = 0
