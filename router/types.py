"""The values routing works on: replica views, the request as the router sees it, per-request state.

A :class:`ReplicaView` is a read-only picture of one replica at the instant of a decision. The
gateway builds views from live replicas (its own in-flight counts, the last scraped ``/metrics``);
the routing benchmark builds the very same views from simulated replicas in virtual time. The
router never reaches a replica itself.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tidal.replicas.metrics import LoadSnapshot

if TYPE_CHECKING:
    from tidal.clock import Clock
    from tidal.router.kv_events import ReplicaBlockIndex

__all__ = ["CycleState", "ReplicaView", "RouteRequest", "RouteResult", "StateKey"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as the router sees it.

    ``inflight`` is the gateway's own count (instant), plus the other gateways' when they share
    load state (:mod:`router.shared`, at most a staleness bound old), and ``prefill_tokens`` the
    prompt tokens of those requests still waiting for their first token (the prefill work queued
    there);
    ``snapshot`` is the last scraped ``/metrics``, taken at ``snapshot_at`` on ``clock``
    (``snapshot_age_s`` old now: a view lives until its replica changes, so its age is read, not
    stored), which also carries other gateways' traffic; ``finished_since_snapshot`` counts the requests this gateway has seen
    end there since that scrape (the snapshot still counts them). ``kv_events`` is the replica's
    exact block index from its KV events (:mod:`router.kv_events`), when it publishes them: a live
    object (the subscriber updates it between decisions, never during one).
    """

    name: str
    pool: str = "default"
    model: str = ""
    group: str = "stable"
    weight: float = 1.0
    healthy: bool = True
    draining: bool = False
    inflight: int = 0
    cap: int = 64
    snapshot: LoadSnapshot | None = None
    snapshot_at: float | None = None
    loaded_adapters: frozenset[str] = frozenset()
    max_loras: int = 0
    prefill_tokens: int = 0
    finished_since_snapshot: int = 0
    region: str | None = None  # its pool's region
    kv_events: ReplicaBlockIndex | None = None
    clock: Clock | None = field(default=None, compare=False, repr=False)

    @property
    def snapshot_age_s(self) -> float:
        """Seconds since the snapshot was taken (``inf`` without one; 0 for a view without a clock)."""
        at = self.snapshot_at
        if at is None:
            return math.inf
        return self.clock.now() - at if self.clock is not None else 0.0

    @property
    def load(self) -> float:
        """Requests on this replica: the gateway's in-flight count, or the scraped running + waiting
        (less what the gateway has seen end since) when that is higher: traffic from other
        gateways, or work the gateway has not seen end."""
        snap = self.snapshot
        at = self.snapshot_at
        clock = self.clock
        # (snapshot_age_s inlined: the scorers read every candidate's load)
        if snap is None or at is None or (clock is not None and clock.now() - at > 10.0):
            return float(self.inflight)
        scraped = snap.num_running + snap.num_waiting - self.finished_since_snapshot
        inflight = float(self.inflight)
        return scraped if scraped > inflight else inflight

    @property
    def free_slots(self) -> int:
        return max(0, self.cap - self.inflight)

    def kv_blocks(self, block_tokens: int) -> int | None:
        """Blocks of ``block_tokens`` this replica's KV cache holds, from its scraped
        ``cache_config_info``; ``None`` before the first scrape that reports it."""
        snap = self.snapshot
        if snap is None or not snap.num_gpu_blocks or not snap.block_size:
            return None
        return max(1, snap.num_gpu_blocks * snap.block_size // max(1, block_tokens))


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs to know about one request.

    * ``model`` -- the base model; ``adapter`` -- the LoRA adapter named by the request, if any.
    * ``prefix_key`` -- hash of the stable prompt prefix (see :mod:`router.prefix`), or ``None``.
    * ``prefix_blocks`` -- chained hashes of the prompt's consecutive blocks (approximate caches).
    * ``block_tokens`` -- about how many tokens one of ``prefix_blocks`` covers (16 for 64
      characters of chat text; 512 for a Mooncake trace block).
    * ``session_key`` -- ``X-Session-Id`` or the request's ``user``, if any.
    * ``regions`` -- the regions whose replicas may serve it (its feature's); ``None``: any.
    * ``engine_keys`` -- the prompt's block keys as the exact KV index names them, per block size
      (:class:`router.kv_events.PromptKeys`, computed on first use); ``None`` when the gateway
      cannot tokenise for this model.
    """

    model: str
    adapter: str | None = None
    prefix_key: int | None = None
    prefix_blocks: tuple[int, ...] = ()
    block_tokens: int = 16
    session_key: str | None = None
    prompt_tokens: int = 0
    request_id: str = ""
    regions: frozenset[str] | None = None
    engine_keys: Callable[[int], tuple[int, ...]] | None = None


class StateKey(Generic[T]):
    """A typed key into :class:`CycleState`: producers put facts, scorers read them."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


@dataclass(slots=True)
class CycleState:
    """Scratch space of one routing decision: the request, the time, the seeded RNG, the facts
    producers attached, and ``notes`` (what happened, for metrics: ring walks, adapter loads)."""

    request: RouteRequest
    now: float
    rng: random.Random
    _data: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def put(self, key: StateKey[T], value: T) -> None:
        self._data[key.name] = value

    def get(self, key: StateKey[T]) -> T | None:
        value: T | None = self._data.get(key.name)
        return value


@dataclass(frozen=True, slots=True)
class RouteResult:
    """The decision: the picked replica, the profile that picked it, every candidate's total score,
    and the notes producers left (``prefix``: home/walked/none, ``ring_walks``, ``adapter_load``)."""

    replica: ReplicaView
    profile: str
    scores: dict[str, float]
    notes: dict[str, Any]
