"""LRUs of block keys that cost the garbage collector nothing to walk.

:class:`ChainLRU` (the ``kv-index``'s) keeps chained keys as a tree of segments, so a touch costs
what a prompt adds; :class:`BlockLRU` (llm-d's approximate index) orders any keys.

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

Keys are unsigned 64-bit integers (the chained block hashes of :mod:`router.prefix` have 60).

Example::

    lru = BlockLRU()
    lru.touch([b2, b1, b0], now)       # b0 is now the most recent
    gone = lru.evict_to(capacity)       # the least recently used keys beyond capacity
    lru.oldest()                        # when the least recently used key was last touched
"""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Container, Mapping, Sequence
from itertools import compress, repeat
from operator import eq

import numpy as np

__all__ = ["BlockLRU", "ChainLRU", "leading_run", "run_between"]

_COMPACT_MIN = 4096  # log entries before a compaction is considered
_DICT_CHECK = 4096  # the fewest new keys between two rebuilds of ChainLRU's key dict
_KEY_SLACK = 4  # ChainLRU's key array: dead keys, and room, up to 1/_KEY_SLACK of the live ones


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


def leading_run(held: Container[int], blocks: Sequence[int], reverse: Sequence[int] | None = None) -> int:
    """How many of ``blocks`` lead the sequence inside ``held``, assuming what is held of the
    chain is a prefix of it (binary search at C speed over ``reverse``, the blocks last to first,
    given when the caller has it; none and all are answered first, in one probe)."""
    return _leading_where(held.__contains__, blocks, reverse)


def run_between(
    held: Callable[[int], bool], blocks: Sequence[int], reverse: Sequence[int], guesses: list[int]
) -> int:
    """:func:`leading_run` where ``held`` holds for ``blocks[0]`` and not for ``blocks[-1]``,
    tried first at ``guesses``: runs found in other replicas' indexes for the same prompt
    (replicas that share its head, a feature's system prompt, mostly hold the same run of it).
    A right guess costs two probes, a wrong one narrows the binary search; the run found joins
    the guesses (at most ``_GUESSES``). ``reverse``: the blocks last to first."""
    n = len(blocks)
    lo, hi = 1, n - 1  # the run is in [lo, hi]
    for g in guesses:
        if not lo <= g <= hi:
            continue
        if not held(blocks[g - 1]):
            hi = g - 1
        elif held(blocks[g]):
            lo = g + 1
        else:
            return g
    # Last to first over the positions lo..hi-1, the blocks go from not held to held.
    run = n - bisect_left(reverse, True, n - hi, n - lo, key=held)
    if len(guesses) < _GUESSES:
        guesses.append(run)
    return run


_GUESSES = 3


def _leads(held: Container[int], chain: Sequence[int], run: int) -> bool:
    """Whether exactly ``run`` keys of ``chain`` lead it inside ``held`` (two probes, for a
    prefix-closed set: the last of the run held, the next one not)."""
    return (
        0 <= run <= len(chain)
        and (run == 0 or chain[run - 1] in held)
        and (run == len(chain) or chain[run] not in held)
    )


def _leading_where(
    ok: Callable[[int], bool], blocks: Sequence[int], reverse: Sequence[int] | None = None
) -> int:
    """How many of ``blocks`` lead the sequence where ``ok`` holds, assuming it holds for a
    prefix of it (see :func:`leading_run`)."""
    hi = len(blocks)
    if not hi or not ok(blocks[0]):
        return 0
    if ok(blocks[-1]):
        return hi
    return run_between(ok, blocks, blocks[::-1] if reverse is None else reverse, [])


class ChainLRU:
    """An LRU of chained block keys (a key names its whole prefix), kept as a tree of segments.

    :class:`BlockLRU` moves every key of a prompt on every touch: at a replica's full KV size
    (~90,000 keys) each move is a cache miss, and a 130-block prompt cost ~80 us. Here a touch
    costs what the prompt adds, not what it repeats. Prompts sent to a replica form a tree (one
    parent per key, since a key names its prefix); its unbranched runs are *segments*, each
    with one last-use time, and a touch stamps the path from the prompt's deepest held key to
    the root -- a few segments -- and appends one segment of its new keys. Eviction takes keys
    from the end of the least recently used segment, so what is held of any chain stays a
    prefix of it (ancestors are never older than their descendants; a touch logs the deepest
    first), the order :class:`BlockLRU` gives when a chain is touched last to first.

    Nothing here is walked by the collector: keys map to segment ids in a ``dict`` of ints, and
    segments are rows of ``array`` columns (their keys contiguous in one key array, root side
    first; a parent found through its last key, so a split re-points no child). A log of
    segment ids orders them by last use: an entry is live when it is its segment's latest
    (``_entry`` holds its position). The log is compacted with numpy when its dead entries
    outnumber the live ones, the key array when its dead keys pass a quarter of the live ones
    (at a replica's full KV size the array is the third largest part of the index, after the
    key dict and the keys' int objects).
    """

    __slots__ = (
        "_base",
        "_end",
        "_entry",
        "_free",
        "_head",
        "_keys",
        "_kept",
        "_log",
        "_node",
        "_parent",
        "_room",
        "_table_bytes",
        "_rooted",
        "_start",
        "_t",
        "_time",
    )

    def __init__(self) -> None:
        self._node: dict[int, int] = {}  # key -> id of its segment
        self._room = 0  # new keys before _node may be rebuilt again (see _rebuild_node)
        self._table_bytes = sys.getsizeof(self._node)  # its size when last looked at
        self._keys = array("Q")  # every segment's keys, contiguous per segment, root side first,
        self._kept = 0  # in _keys[:_kept]; the rest is room (grown by doubling, see _grow)
        self._start = array("q")  # per segment id: its keys are _keys[_start:_end]
        self._end = array("q")
        self._time = array("d")  # per segment id: its last use
        self._parent = array("Q")  # per segment id: the key before its first (see _rooted)
        self._rooted = array("B")  # per segment id: 1 when it starts a chain (no parent)
        self._entry = array("q")  # per segment id: absolute log position of its live entry; -1 free
        self._free = array("q")  # segment ids to reuse
        self._log = array("q")  # segment ids by last use, oldest first, from _head on
        self._head = 0
        self._base = 0  # absolute position of _log[0]
        self._t = -math.inf  # the latest touch time (strictly increasing per touch call)

    def __len__(self) -> int:
        return len(self._node)

    def __contains__(self, key: object) -> bool:
        return key in self._node

    @property
    def held(self) -> Mapping[int, int]:
        """The keys held (read-only use; the values are internal)."""
        return self._node

    def leading(self, chain: Sequence[int], reverse: Sequence[int] | None = None) -> int:
        """How many of ``chain`` (root side first) lead it inside the LRU."""
        return leading_run(self._node, chain, reverse)

    def recent(self, chain: Sequence[int], since: float) -> int:
        """How many of ``chain`` lead it inside the LRU with a last use at or after ``since``
        (along a chain, last uses never increase: a binary search)."""
        node, time_ = self._node, self._time

        def recent(key: int) -> bool:
            seg = node.get(key)
            return seg is not None and time_[seg] >= since

        return _leading_where(recent, chain)

    def touch(self, chain: Sequence[int], now: float, held: int | None = None) -> None:
        """Mark the chain (root side first) used at ``now``: every key of it is now more recent
        than any key outside it, its root the most recent. ``held``: how many of its keys lead
        it inside the LRU, when the caller has just asked (:meth:`leading`)."""
        if not chain:
            return
        t = now if now > self._t else math.nextafter(self._t, math.inf)
        self._t = t
        node = self._node
        p = held if held is not None and _leads(node, chain, held) else leading_run(node, chain)
        seg = -1
        if p:
            last = chain[p - 1]
            seg = node[last]
            if self._keys[self._end[seg] - 1] != last:
                seg = self._split(seg, last)
        if p < len(chain):
            self._grow(chain[p:], chain[p - 1] if p else None, t)
        time_, entry, parent, rooted, log = self._time, self._entry, self._parent, self._rooted, self._log
        steps = len(entry)  # (a bound for keys that do not chain, which could make a cycle)
        while seg >= 0 and steps:  # the path to the root, deepest first
            time_[seg] = t
            entry[seg] = self._base + len(log)
            log.append(seg)
            seg = -1 if rooted[seg] else node.get(parent[seg], -1)
            steps -= 1
        if len(log) > 2 * (len(self._entry) - len(self._free)) + _COMPACT_MIN:
            self._compact_log()
        if self._room <= 0 and sys.getsizeof(self._node) > self._table_bytes:
            self._rebuild_node()

    def evict_to(self, capacity: int) -> list[int]:
        """Drop the least recently used keys until at most ``capacity`` remain; returns them."""
        node = self._node
        excess = len(node) - capacity
        if excess <= 0:
            return []
        keys, start, end, entry, log = self._keys, self._start, self._end, self._entry, self._log
        h, base = self._head, self._base
        gone: list[int] = []
        while excess > 0:
            seg = log[h]
            if entry[seg] != base + h:  # a stale entry: the segment was used since, or freed
                h += 1
                continue
            s, e = start[seg], end[seg]
            k = min(excess, e - s)
            cut = keys[e - k : e].tolist()
            cut.reverse()  # deepest first
            deque(map(node.pop, cut, repeat(None)), maxlen=0)
            gone += cut
            excess = len(node) - capacity  # (a key listed twice in a segment counts once)
            if k == e - s:
                entry[seg] = -1
                self._free.append(seg)
                h += 1
            else:
                end[seg] = e - k
        self._head = h
        if self._kept > len(node) + len(node) // _KEY_SLACK + _COMPACT_MIN:
            self._compact_keys()
        return gone

    def oldest(self) -> float | None:
        """When the least recently used key was last touched; ``None`` when empty."""
        if not self._node:
            return None
        log, entry, h, base = self._log, self._entry, self._head, self._base
        while entry[log[h]] != base + h:
            h += 1
        self._head = h
        return self._time[log[h]]

    def _new_id(self) -> int:
        if self._free:
            return self._free.pop()
        for column in (self._start, self._end, self._parent, self._entry):
            column.append(0)
        self._time.append(0.0)
        self._rooted.append(0)
        return len(self._entry) - 1

    def _grow(self, new: Sequence[int], parent: int | None, t: float) -> None:
        """A segment of the keys ``new``, under the segment ending at ``parent``; logged."""
        node = self._node
        seg = self._new_id()
        # setdefault at C speed: a key already held elsewhere (never, for keys that chain)
        # ends the segment before it, so a key always belongs to one segment.
        found = list(map(node.setdefault, new, repeat(seg)))
        self._room -= len(new)
        if found.count(seg) != len(new):
            j = next(i for i, s in enumerate(found) if s != seg)
            ours = set(new[:j])
            for k in new[j:]:
                if k not in ours and node.get(k) == seg:
                    del node[k]
            new = new[:j]
            if not new:
                self._free.append(seg)
                self._entry[seg] = -1
                return
        # Into the room at the end of the key array, grown by a quarter when short: ``array.extend``
        # grows by a sixteenth, and each growth copied the whole array (~1 ms at 40,000 keys).
        keys, used = self._keys, self._kept
        if used + len(new) > len(keys):
            keys.frombytes(bytes(8 * max(len(keys) // _KEY_SLACK, len(new), 1024)))
        keys[used : used + len(new)] = array("Q", new)
        self._start[seg] = used
        self._end[seg] = self._kept = used + len(new)
        self._time[seg] = t
        self._rooted[seg] = parent is None
        self._parent[seg] = 0 if parent is None else parent
        self._entry[seg] = self._base + len(self._log)
        self._log.append(seg)

    def _split(self, seg: int, last: int) -> int:
        """Cut ``seg`` after its key ``last``; returns the id of the part ending at ``last``.
        The smaller part gets a new id (its keys re-pointed); the tail keeps the old last use
        and log entry, the head is about to be stamped."""
        keys, start, end = self._keys, self._start, self._end
        s, e = start[seg], end[seg]
        cut = keys.index(last, s, e) + 1
        new = self._new_id()
        if cut - s <= e - cut:  # the head is new
            start[new], end[new] = s, cut
            self._parent[new], self._rooted[new] = self._parent[seg], self._rooted[seg]
            self._entry[new] = -2  # not logged yet: the caller's path logs it
            start[seg] = cut
            self._parent[seg], self._rooted[seg] = last, 0
            self._node.update(zip(keys[s:cut].tolist(), repeat(new)))
            return new
        start[new], end[new] = cut, e  # the tail is new: it takes over the live log entry
        self._parent[new], self._rooted[new] = last, 0
        self._time[new] = self._time[seg]
        pos = self._entry[seg]
        self._entry[new] = pos
        if pos >= 0:
            self._log[pos - self._base] = new
        self._entry[seg] = -2
        end[seg] = cut
        self._node.update(zip(keys[cut:e].tolist(), repeat(new)))
        return seg

    def _rebuild_node(self) -> None:
        """CPython just grew the key dict: copy it into one sized for its live keys, when that
        is smaller and leaves room.

        An LRU at capacity inserts as many keys as it drops, and a dict never reuses the slots
        of dropped keys: when they run out, CPython rebuilds it at the power of two at or above
        three times its live keys. For a replica's 89,730 blocks that is 2^19 slots (10 MB); a
        dict filled by copying is sized from 1.5 times its keys, 2^18 (5 MB), which leaves room
        for 85,000 inserts. The copy halves the dict, the largest part of a full index (about
        14.5 MB per replica become 9.5), for one more copy per that many inserts. It is not made
        where it would leave room for fewer than half the live keys (CPython's table is kept),
        and the next is not considered before half as many inserts as there are live keys, so
        copies stay rare whatever the interpreter's sizes."""
        node = self._node
        n = len(node)
        size = 1 << max(3, ((3 * n + 1) // 2 - 1).bit_length())  # (CPython's estimate for a copy)
        if (2 * size) // 3 - n >= n // 2:
            fresh: dict[int, int] = {}
            fresh.update(node)  # (from a dict with dropped keys: sized from its live keys)
            if sys.getsizeof(fresh) < sys.getsizeof(node):
                self._node = fresh
        self._table_bytes = sys.getsizeof(self._node)
        self._room = max(n // 2, _DICT_CHECK)

    def _compact_log(self) -> None:
        """Keep only the live entries, in order (numpy, at C speed)."""
        log = np.frombuffer(self._log, np.int64)[self._head :]
        entry = np.frombuffer(self._entry, np.int64)
        live = log[entry[log] == np.arange(self._head, self._head + len(log)) + self._base]
        entry[live] = np.arange(len(live))
        del log, entry
        self._log = array("q", live.tobytes())
        self._head = self._base = 0

    def _compact_keys(self) -> None:
        """Rewrite the key array with only the live segments' keys (numpy, at C speed)."""
        entry = np.frombuffer(self._entry, np.int64)
        start = np.frombuffer(self._start, np.int64)
        end = np.frombuffer(self._end, np.int64)
        live = np.flatnonzero(entry != -1)
        lengths = end[live] - start[live]
        new_start = np.cumsum(lengths) - lengths
        # every live key's old position: its segment's old start plus its offset in it
        offsets = np.arange(int(lengths.sum())) - np.repeat(new_start, lengths)
        keys = np.frombuffer(self._keys, np.uint64)[np.repeat(start[live], lengths) + offsets]
        start[live] = new_start
        end[live] = new_start + lengths
        del entry, start, end
        self._keys = array("Q", keys.tobytes())
        self._kept = len(keys)
        # room to grow into until the next compaction is due (dead space past the live keys)
        self._keys.frombytes(bytes(8 * (len(keys) // _KEY_SLACK + _COMPACT_MIN)))
