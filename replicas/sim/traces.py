"""Workloads for the simulated replica: real trace loaders and a built-in synthetic generator.

Benchmarks (``bench/``) and the capacity planner (``scheduler/plan``) replay them in virtual time.

Every loader returns a list of :class:`TraceRequest` sorted by arrival. Prefixes are described
the Mooncake way: ``hash_ids`` names each ``block_tokens``-token block of the prompt *together
with everything before it*, so two requests that share their first k ids share a
``k * block_tokens``-token prefix (the last block may be partial).

* :func:`load_mooncake` -- Mooncake FAST'25 JSONL (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token blocks). Bucketed timestamps (the conversation
  trace's 3 s buckets) are spread uniformly within their bucket, seeded.
* :func:`load_azure` -- Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``):
  arrivals and lengths only, no prefix information (each prompt gets unique ids).
* :func:`synthetic_workload` -- shared system prompts (Zipf popularity) and multi-turn sessions,
  for machines without the real traces.
* :func:`find_trace`, :func:`load_default` -- ``../shared/traces/`` (relative to the project
  root), ``$TIDAL_TRACES_DIR`` or an explicit file; synthetic when none is there.
* :func:`block_hashes` -- one request's prompt as chained hashes of ``block_size``-token blocks
  (each 512-token id expanded into 32 chained 16-token sub-blocks) for the simulator;
  :func:`prompt_text` -- deterministic text with equal text for equal prefixes.
* :func:`ideal_hit_ratio` -- the prefix-cache hit ratio of one infinite cache (Mooncake reports
  about 37 % for the conversation trace); :func:`capacity_hit_ratio` -- that of one LRU cache of
  a given size (a whole cluster's KV capacity: what a router over LRU engines, as vLLM's are, can
  approach but hardly beat, since each request's prefix must be resident on the one replica it
  goes to); :func:`belady_hit_ratio` -- that of one cache of that size which evicts the block
  needed furthest in the future (clairvoyant: how much of the gap to the ideal is LRU's).

Example::

    reqs, source = load_default("mooncake_conversation_trace.jsonl")
    print(source, len(reqs), ideal_hit_ratio(reqs))
    hashes = block_hashes(reqs[0], block_size=16)   # len == reqs[0].input_length // 16
    capacity_hit_ratio(reqs, capacity_tokens=8 * 1_443_920)  # 8 replicas' KV, one LRU
"""

from __future__ import annotations

import csv
import heapq
import json
import math
import os
import random
import statistics
from collections import OrderedDict, defaultdict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tidal.replicas.words import COMMON_WORDS

__all__ = [
    "TraceRequest",
    "block_hashes",
    "belady_hit_ratio",
    "capacity_hit_ratio",
    "find_trace",
    "ideal_hit_ratio",
    "load_azure",
    "load_default",
    "load_mooncake",
    "load_trace",
    "prompt_text",
    "synthetic_workload",
]

MOONCAKE_BLOCK_TOKENS = 512
# Hash ids of one trace are small integers; ids of requests without prefix information (Azure)
# start here so they never collide with a real trace's ids in the same run.
_UNIQUE_ID_BASE = 1 << 40
_MAX_TRACE_BYTES = 512 * 1024 * 1024  # refuse absurd files instead of reading them into memory


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload.

    ``hash_ids``: chained ids of the prompt's ``block_tokens``-token blocks (empty when the
    workload has no prefix information); ``session_id`` and ``turn`` group the turns of one
    conversation when the workload knows them.
    """

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    session_id: str | None = None
    turn: int = 1


# -- loaders -----------------------------------------------------------------------------------


def _check_size(path: Path) -> None:
    size = path.stat().st_size
    if size > _MAX_TRACE_BYTES:
        raise ValueError(f"{path} is {size} bytes; traces above {_MAX_TRACE_BYTES} bytes are refused")


def load_mooncake(path: str | Path, *, seed: int = 0, jitter_s: float | None = None) -> list[TraceRequest]:
    """Load a Mooncake JSONL trace.

    ``jitter_s``: spread arrivals uniformly over ``[t, t + jitter_s)``; by default the bucket
    width is detected (the median gap between distinct timestamps when it is 1 s or more, as in
    the conversation trace's 3 s buckets) and 0 otherwise.
    """
    p = Path(path)
    _check_size(p)
    rows = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
                rows.append(
                    (
                        float(d["timestamp"]) / 1000.0,
                        int(d["input_length"]),
                        int(d["output_length"]),
                        tuple(int(h) for h in d.get("hash_ids", ())),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{p}:{n}: not a Mooncake trace line ({exc})") from None
    if jitter_s is None:
        stamps = sorted({r[0] for r in rows})
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        med = statistics.median(gaps) if gaps else 0.0
        jitter_s = med if med >= 1.0 else 0.0
    rng = random.Random(seed)
    out = [
        TraceRequest(
            arrival_s=ts + (rng.random() * jitter_s if jitter_s else 0.0),
            input_length=max(1, inp),
            output_length=max(1, outp),
            hash_ids=ids,
        )
        for ts, inp, outp, ids in rows
    ]
    out.sort(key=lambda r: r.arrival_s)
    return out


def load_azure(path: str | Path) -> list[TraceRequest]:
    """Load an Azure LLM inference CSV (2023 code/conv traces): arrivals and lengths."""
    p = Path(path)
    _check_size(p)
    stamps: list[tuple[float, int, int]] = []
    with p.open(newline="") as f:
        for n, row in enumerate(csv.DictReader(f), 2):
            try:
                raw = row["TIMESTAMP"].strip()
                # Python parses at most 6 fractional digits; the files have 7.
                if "." in raw:
                    head, frac = raw.split(".", 1)
                    raw = f"{head}.{frac[:6]}"
                ts = datetime.fromisoformat(raw).timestamp()
                stamps.append((ts, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{p}:{n}: not an Azure trace row ({exc})") from None
    if not stamps:
        return []
    t0 = min(s[0] for s in stamps)
    out = []
    for i, (ts, ctx, gen) in enumerate(sorted(stamps)):
        ctx = max(1, ctx)
        nblocks = -(-ctx // MOONCAKE_BLOCK_TOKENS)
        base = _UNIQUE_ID_BASE + i * 4096  # unique ids: Azure has no prefix information
        out.append(TraceRequest(ts - t0, ctx, max(1, gen), tuple(range(base, base + nblocks))))
    return out


def load_trace(path: str | Path, *, seed: int = 0) -> list[TraceRequest]:
    """Load a Mooncake ``.jsonl`` or an Azure ``.csv`` trace by its extension."""
    p = Path(path)
    if p.suffix == ".jsonl":
        return load_mooncake(p, seed=seed)
    if p.suffix == ".csv":
        return load_azure(p)
    raise ValueError(f"unknown trace format {p.suffix!r} (expected .jsonl or .csv)")


def find_trace(name: str, project_root: str | Path | None = None) -> Path | None:
    """Where the shared trace ``name`` is, if anywhere: ``$TIDAL_TRACES_DIR`` then ``../shared/traces``."""
    roots: list[Path] = []
    env = os.environ.get("TIDAL_TRACES_DIR")
    if env:
        roots.append(Path(env))
    root = Path(project_root) if project_root else Path(__file__).resolve().parents[2]
    roots.append(root.parent / "shared" / "traces")
    for r in roots:
        candidate = r / name
        if candidate.is_file():
            return candidate
    return None


def load_default(
    name: str = "mooncake_conversation_trace.jsonl",
    *,
    trace: str | Path | None = None,
    seed: int = 0,
    synthetic_duration_s: float = 3600.0,
) -> tuple[list[TraceRequest], str]:
    """The workload a benchmark should use, and a line saying which one it is.

    An explicit ``trace`` file wins; otherwise the shared trace ``name`` when present; otherwise
    the built-in synthetic workload.
    """
    if trace is not None:
        return load_trace(trace, seed=seed), f"trace file {trace}"
    found = find_trace(name)
    if found is not None:
        return load_trace(found, seed=seed), f"real trace {found.name}"
    reqs = synthetic_workload(duration_s=synthetic_duration_s, seed=seed)
    return reqs, f"built-in synthetic workload ({len(reqs)} requests; {name} not found)"


# -- synthetic workload ------------------------------------------------------------------------


def synthetic_workload(
    *,
    duration_s: float = 600.0,
    rate_per_s: float = 3.4,
    num_system_prompts: int = 20,
    system_prompt_tokens: tuple[int, int] = (512, 4096),
    user_tokens: tuple[int, int] = (64, 2048),
    output_tokens: tuple[int, int] = (32, 800),
    session_turns: float = 3.0,
    think_s: float = 30.0,
    zipf_s: float = 1.1,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    seed: int = 0,
) -> list[TraceRequest]:
    """Conversations that share system prompts, with several turns each (open loop).

    New sessions arrive as a Poisson process at ``rate_per_s / session_turns``; each picks a
    system prompt by Zipf popularity and runs a geometric number of turns (mean
    ``session_turns``), each ``think_s`` (exponential) after the previous one. Turn k's prompt is
    the system prompt, all earlier turns (user text and answers) and a new user message, so it
    extends turn k-1's prefix. Lengths are log-uniform within the given ranges.
    """
    rng = random.Random(seed)
    next_id = 1

    def new_ids(tokens: int) -> list[int]:
        nonlocal next_id
        n = -(-tokens // block_tokens)
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    def log_uniform(lo_hi: tuple[int, int]) -> int:
        lo, hi = lo_hi
        return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    # System prompts are whole blocks, so every session of one prompt shares all its blocks.
    systems = []
    for _ in range(num_system_prompts):
        blocks = max(1, log_uniform(system_prompt_tokens) // block_tokens)
        systems.append(new_ids(blocks * block_tokens))
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_system_prompts)]
    out: list[TraceRequest] = []
    t = 0.0
    session = 0
    session_rate = rate_per_s / max(session_turns, 1.0)
    while True:
        t += rng.expovariate(session_rate)
        if t >= duration_s:
            break
        session += 1
        sys_ids = rng.choices(systems, weights)[0]
        history = list(sys_ids)
        history_tokens = len(sys_ids) * block_tokens
        turn_t = t
        turn = 1
        while turn_t < duration_s:
            user = log_uniform(user_tokens)
            answer = log_uniform(output_tokens)
            # The new user text starts a fresh block so the shared history stays block-aligned.
            prompt_ids = history + new_ids(user)
            input_len = history_tokens + user
            out.append(
                TraceRequest(turn_t, input_len, answer, tuple(prompt_ids), block_tokens, f"s{session}", turn)
            )
            if rng.random() > 1.0 - 1.0 / max(session_turns, 1.0):
                break
            # The next turn's prompt holds this answer as well (whole blocks, for simplicity).
            history = prompt_ids + new_ids(answer)
            history_tokens = len(history) * block_tokens
            turn_t += rng.expovariate(1.0 / think_s)
            turn += 1
    out.sort(key=lambda r: r.arrival_s)
    return out


# -- for the simulator and for HTTP benchmarks ------------------------------------------------


def block_hashes(req: TraceRequest, block_size: int = 16) -> list[int]:
    """The prompt's full ``block_size``-token blocks as chained hashes (for ``SimRequest``).

    Each ``block_tokens``-token id is expanded into ``block_tokens / block_size`` sub-blocks;
    since an id already names its whole prefix, ``(id, j)`` names sub-block j with its prefix.
    """
    bt = req.block_tokens
    if bt % block_size:
        raise ValueError(f"trace block of {bt} tokens is not a multiple of the engine block ({block_size})")
    per = bt // block_size
    n_full = req.input_length // block_size
    out: list[int] = []
    ids = req.hash_ids
    if not ids:
        # No prefix information: a prompt of its own.
        salt = hash(("tidal-trace-unique", req.arrival_s, req.input_length, req.output_length))
        return [hash((salt, j)) for j in range(n_full)]
    shift = per.bit_length() + 1
    for h in ids:
        base = (h + 1) << shift
        out.extend(range(base, base + per))
        if len(out) >= n_full:
            break
    if len(out) < n_full:
        # Fewer ids than the length needs (a malformed line): the rest is unique to the request.
        salt = hash(("tidal-trace-tail", ids, req.input_length))
        out.extend(hash((salt, j)) for j in range(n_full - len(out)))
    del out[n_full:]
    return out


def prompt_text(req: TraceRequest, *, tokens_per_block: int | None = None) -> str:
    """Deterministic text of about ``input_length`` words; equal id prefixes give equal text."""
    bt = tokens_per_block or req.block_tokens
    words: list[str] = []
    remaining = req.input_length
    ids: Iterable[int] = req.hash_ids or [hash(("tidal-trace-unique", req.arrival_s, req.input_length))]
    for h in ids:
        n = min(bt, remaining)
        rng = random.Random(h)
        words.extend(rng.choice(COMMON_WORDS) for _ in range(n))
        remaining -= n
        if remaining <= 0:
            break
    return " ".join(words)


def _leading_hit_tokens(r: TraceRequest, held: Container[int]) -> int:
    """Prompt tokens of ``r`` in its leading run of block ids found in ``held`` (the last block
    counts only the tokens it holds)."""
    hit = 0
    for i, h in enumerate(r.hash_ids):
        if h not in held:
            break
        hit += min(r.block_tokens, r.input_length - i * r.block_tokens)
    return hit


def ideal_hit_ratio(requests: Sequence[TraceRequest]) -> float:
    """Prompt tokens a single infinite prefix cache would serve, over all prompt tokens.

    A block hits when its id (a prefix hash) was seen in an earlier request; the last block of
    a prompt counts only the tokens it holds.
    """
    seen: set[int] = set()
    hit = total = 0
    for r in sorted(requests, key=lambda x: x.arrival_s):
        total += r.input_length
        hit += _leading_hit_tokens(r, seen)
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def capacity_hit_ratio(requests: Sequence[TraceRequest], capacity_tokens: int) -> float:
    """The hit ratio of an oracle that serves every request from **one** prefix cache of
    ``capacity_tokens`` tokens (e.g. the whole cluster's KV capacity) under LRU.

    Counted as :func:`ideal_hit_ratio` counts (a leading run of seen block ids, the last block
    only for the tokens it holds), but a block is forgotten once ``capacity_tokens //
    block_tokens`` more recently used blocks are held. A request touches its blocks from last to
    first, so its shared head is the most recent and its tail is evicted first (vLLM frees a
    request's blocks in reverse order for the same reason). Running requests' blocks are not
    pinned, so this is an optimistic bound for a real engine.
    """
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in sorted(requests, key=lambda x: x.arrival_s):
        cap = max(1, capacity_tokens // r.block_tokens)
        total += r.input_length
        hit += _leading_hit_tokens(r, lru)
        for h in reversed(r.hash_ids):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > cap:
            lru.popitem(last=False)
    return hit / total if total else 0.0


def belady_hit_ratio(requests: Sequence[TraceRequest], capacity_tokens: int) -> float:
    """The hit ratio of one prefix cache of ``capacity_tokens`` tokens that, when full, evicts the
    block whose next use is furthest away (Belady's clairvoyant policy), counted as
    :func:`capacity_hit_ratio` counts. No engine knows the future; this shows how far an LRU cache
    of the same size is from what the size allows (on the Mooncake conversation trace most new
    blocks are never used again, and LRU keeps them as long as any other)."""
    ordered = sorted(requests, key=lambda x: x.arrival_s)
    uses: defaultdict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(ordered):
        for h in r.hash_ids:
            uses[h].append(i)
    seen_uses: defaultdict[int, int] = defaultdict(int)  # uses of each block up to now
    never = len(ordered)
    cached: dict[int, int] = {}  # block -> index of the request that next uses it
    furthest: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hit = total = 0
    for r in ordered:
        cap = max(1, capacity_tokens // r.block_tokens)
        total += r.input_length
        hit += _leading_hit_tokens(r, cached)
        for h in r.hash_ids:
            seen_uses[h] += 1
            later = uses[h]
            nxt = later[seen_uses[h]] if seen_uses[h] < len(later) else never
            cached[h] = nxt
            heapq.heappush(furthest, (-nxt, h))
        while len(cached) > cap:
            nxt, h = heapq.heappop(furthest)
            if cached.get(h) == -nxt:
                del cached[h]
    return hit / total if total else 0.0
