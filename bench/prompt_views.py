"""What each routing policy's live system sees of a trace request.

A trace names blocks, not text; a live router sees a chat request. This module turns a trace
request into the chat request its conversation implies and reads it the way each live system
does, so the routing benchmark compares policies on their real inputs:

* **Text.** Each block id becomes its own deterministic text (:func:`block_text`), so equal
  prefixes give equal text. A block's characters per token are drawn from its id between 3.2 and
  4.8 (English BPE averages about 4; code and numbers fewer, prose more), so the gateway's
  bytes / 4 token estimate is off per block as it is live, and right on average.
* **Conversations.** Mooncake's trace carries no conversation ids, but a turn's prompt repeats the
  whole previous prompt: a request whose blocks extend an earlier request's full blocks is that
  conversation's next turn (:func:`conversations`; a workload that knows its sessions, as the
  synthetic one does, keeps them). Block 0 is the system message; the blocks between one turn's
  end and the next are alternately a user and an assistant message; the last is a user message.
  The conversation's id is the request's session key (the ``X-Session-Id`` header a client
  sends), so the session ring is exercised as it is live.
* **Views.** ``live`` is :func:`router.prefix.chat_view` -- the very function the gateway calls --
  with its token estimate (:func:`priority.features.estimate_tokens`): ``tidal`` and ``llm_d``
  (the Gateway API Inference Extension's prefix plugin hashes 64-character blocks and matches at
  most 256 of them, about 4K tokens; the gateway's defaults are the same). ``full`` is the same
  hashing without the cap: SGLang's router keeps a character tree of the whole prompt.

A request without block ids (the Azure traces) gets text of its own, shared with nothing, and no
session.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from tidal.bench.traces import TraceRequest
from tidal.priority.features import estimate_tokens
from tidal.router.prefix import MAX_BLOCKS, chat_view

__all__ = [
    "CHARS_PER_TOKEN",
    "RouteView",
    "block_text",
    "conversations",
    "prepare_views",
    "trace_messages",
]

CHARS_PER_TOKEN = (3.2, 4.8)
_U64 = 0xFFFF_FFFF_FFFF_FFFF
_UNCAPPED = 1 << 20  # blocks: far beyond any prompt of the traces (64 Mi characters)


def _chars_per_token(block_id: int) -> float:
    lo, hi = CHARS_PER_TOKEN
    mix = (block_id * 0x9E3779B97F4A7C15) & _U64
    return lo + (hi - lo) * (mix >> 48) / 65536.0


def block_text(block_id: int, tokens: int, *, salt: bytes = b"") -> str:
    """Deterministic text of ``tokens`` tokens for one block id (the same id, the same text)."""
    n = max(1, round(tokens * _chars_per_token(block_id)))
    seed = salt + (block_id & _U64).to_bytes(8, "little")
    digest = hashlib.shake_128(seed).hexdigest((n + 1) // 2)
    return digest[:n]


def conversations(workload: Sequence[TraceRequest]) -> tuple[list[str | None], list[tuple[int, ...]]]:
    """Each request's conversation id and the block counts at which its earlier turns ended.

    A workload's own ``session_id`` wins; otherwise request r continues the latest earlier request
    p whose full blocks (all but p's last, which holds p's leftover tokens) r's blocks start with.
    Block 0 alone never links two requests (Mooncake starts every prompt with one shared block)."""
    by_last_full: dict[int, int] = {}  # id of a request's last full block (depth >= 1) -> request
    sessions: list[str | None] = [None] * len(workload)
    bounds: list[tuple[int, ...]] = [()] * len(workload)
    for i, req in enumerate(workload):
        ids = req.hash_ids
        parent = None
        for depth in range(len(ids) - 1, 0, -1):
            if (p := by_last_full.get(ids[depth])) is not None:
                parent = p
                break
        if parent is not None:
            sessions[i] = sessions[parent]
            bounds[i] = (*bounds[parent], len(workload[parent].hash_ids) - 1)
        elif ids:
            sessions[i] = f"conv-{i}"
        if req.session_id is not None:
            sessions[i] = req.session_id
        if len(ids) >= 3:
            by_last_full[ids[-2]] = i
    return sessions, bounds


def trace_messages(req: TraceRequest, bounds: Sequence[int] = (), *, unique: int = 0) -> list[dict[str, str]]:
    """The chat messages a trace request stands for (see the module docstring); ``unique`` names a
    request without block ids, whose text is its own."""
    if not req.hash_ids:
        return [{"role": "user", "content": block_text(unique, req.input_length, salt=b"unique")}]
    bt = req.block_tokens
    texts: list[str] = []
    left = req.input_length
    for h in req.hash_ids:
        n = min(bt, left)
        if n <= 0:
            break
        texts.append(block_text(h, n))
        left -= n
    messages = [{"role": "system", "content": texts[0]}]
    cuts = [b for b in bounds if 1 <= b < len(texts)]
    edges = sorted({1, *cuts, len(texts)})
    roles = ("user", "assistant")
    for k, (a, b) in enumerate(zip(edges, edges[1:], strict=False)):
        messages.append({"role": roles[k % 2], "content": "".join(texts[a:b])})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": ""})
    return messages


@dataclass(frozen=True, slots=True)
class RouteView:
    """One request as the live routers read it: the gateway's key, blocks (``live``, capped as
    the gateway caps them) and token estimate, the uncapped blocks (``full``), its session."""

    prefix_key: int | None
    live: array[int]
    full: array[int]
    prompt_tokens: int
    session_key: str | None


def prepare_views(workload: Sequence[TraceRequest]) -> list[RouteView]:
    """Every request's :class:`RouteView`, in the workload's order."""
    sessions, bounds = conversations(workload)
    views: list[RouteView] = []
    for i, req in enumerate(workload):
        messages = trace_messages(req, bounds[i], unique=i)
        # Blocks are chained, so the gateway's capped blocks are the first MAX_BLOCKS of these.
        view = chat_view(messages, max_blocks=_UNCAPPED)
        views.append(
            RouteView(
                view.prefix_key,
                array("Q", view.blocks[:MAX_BLOCKS]),
                array("Q", view.blocks),
                estimate_tokens(view.size),
                sessions[i],
            )
        )
    return views
