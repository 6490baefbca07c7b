"""Prefix keys and prefix blocks: what cache-aware routing hashes.

Two views of a prompt's prefix:

* the **stable prefix key** -- one hash that names the conversation or application a request
  belongs to. For chat it is the system (and developer) messages, the tools and the **first user
  turn**. The system prompt alone is not enough: when every request of an application starts with
  the same system prompt (Mooncake's conversation trace starts every request with one shared
  block), a key made of it alone sends all traffic to one ring position and the bounded-load walk
  then scatters it without locality. Adding the first user turn gives each conversation its own
  position, so every later turn of it (which repeats the history) lands where its prefix is
  cached, while the shared system prompt is cached once per replica.
* **prefix blocks** -- chained hashes of consecutive fixed-size pieces of the prompt, so that two
  prompts sharing their first ``k`` pieces share their first ``k`` block hashes. Approximate
  cache indexes (llm-d's prefix scorer, SGLang's tree) match on these. Chat prompts are cut into
  64-character pieces (about 16 tokens, llm-d's default). A block hash has 60 bits: an index
  holds a replica's whole KV cache in them (90,000 blocks of a 70B replica, millions over a
  pool), and CPython stores an int below ``2**60`` in 32 bytes, one of 64 bits in 48.

The gateway reads a chat request through :func:`chat_view` (its size for the token estimate,
its key, its blocks); the routing benchmark reads the messages it synthesises for a trace
through the same function, so the router sees in both what it sees live.

Example::

    view = chat_view(body["messages"], body.get("tools"))
    view.size, view.prefix_key, view.blocks
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BLOCK_CHARS",
    "BLOCK_HASH_BITS",
    "MAX_BLOCKS",
    "ChatView",
    "chain_blocks",
    "chat_prefix_key",
    "chat_view",
    "completion_prefix_key",
    "render_messages",
    "text_blocks",
]

BLOCK_CHARS = 64
MAX_BLOCKS = 256  # llm-d's cap: 256 x 64 characters, about 4K tokens of a prompt
BLOCK_HASH_BITS = 60  # (see the module's docstring)
BLOCK_HASH_SHIFT = 64 - BLOCK_HASH_BITS
_SEP = b"\x1f"


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(json.dumps(part, sort_keys=True, default=str))
        return "\n".join(parts)
    if content is None:
        return ""
    return json.dumps(content, sort_keys=True, default=str)


def chat_prefix_key(messages: Sequence[Any], tools: Any = None) -> int | None:
    """Hash of the system/developer messages, the tools and the first user turn; ``None`` when
    the request has none of them."""
    pieces: list[bytes] = []
    first_user: str | None = None
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role in ("system", "developer"):
            pieces.append(_content_text(m.get("content")).encode())
        elif role == "user":
            first_user = _content_text(m.get("content"))
            break
    if tools:
        pieces.append(json.dumps(tools, sort_keys=True, default=str).encode())
    if first_user is not None:
        pieces.append(b"user:" + first_user.encode())
    if not pieces:
        return None
    return _h(_SEP.join(pieces))


def completion_prefix_key(prompt: Any, chars: int = 16 * BLOCK_CHARS) -> int | None:
    """A completion prompt has no structure: its first ``chars`` characters (about 256 tokens,
    SGLang's ``prefix_hash`` length) name its prefix."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _h(prompt[:chars].encode()) if prompt else None
    if isinstance(prompt, list) and prompt:
        first = prompt[0] if isinstance(prompt[0], list) else prompt
        return _h(json.dumps(first[: chars // 4]).encode())
    return None


def render_messages(messages: Sequence[Any]) -> str:
    """The messages as one string, in order (role and text), for block hashing."""
    out: list[str] = []
    for m in messages:
        if isinstance(m, dict):
            out.append(f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n")
    return "".join(out)


def chain_blocks(pieces: Iterable[bytes]) -> tuple[int, ...]:
    """Chained hashes: block i's hash covers pieces 0..i (the digest's first 60 bits)."""
    out: list[int] = []
    prev = b""
    for piece in pieces:
        d = hashlib.blake2b(prev + piece, digest_size=8).digest()
        out.append(int.from_bytes(d, "big") >> BLOCK_HASH_SHIFT)
        prev = d
    return tuple(out)


def text_blocks(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """Chained hashes of the text's full ``block_chars`` pieces (at most ``max_blocks``)."""
    data = text.encode()
    n = min(len(data) // block_chars, max_blocks)
    return chain_blocks(data[i * block_chars : (i + 1) * block_chars] for i in range(n))


@dataclass(frozen=True, slots=True)
class ChatView:
    """What routing reads of a chat request: ``size`` (UTF-8 bytes of the messages' text and
    the tools, for the token estimate), the stable ``prefix_key`` and the ``blocks``."""

    size: int
    prefix_key: int | None
    blocks: tuple[int, ...]


def chat_view(
    messages: Sequence[Any], tools: Any = None, *, blocks: bool = True, max_blocks: int = MAX_BLOCKS
) -> ChatView:
    """The gateway's view of a chat request; ``blocks=False`` skips the block hashes (no
    producer of the routing profile reads them)."""
    size = sum(len(_content_text(m.get("content")).encode()) for m in messages if isinstance(m, dict))
    if tools:
        size += len(json.dumps(tools, sort_keys=True, default=str).encode())
    hashed = text_blocks(render_messages(messages), max_blocks=max_blocks) if blocks else ()
    return ChatView(size, chat_prefix_key(messages, tools), hashed)
