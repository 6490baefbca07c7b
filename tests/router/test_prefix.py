"""Prefix keys name a conversation; prefix blocks chain."""

from __future__ import annotations

from tidal.router.prefix import (
    BLOCK_HASH_BITS,
    chat_prefix_key,
    chat_view,
    completion_prefix_key,
    render_messages,
    text_blocks,
)

SYSTEM = {"role": "system", "content": "You are a support bot for Acme."}


def test_chat_key_is_system_tools_and_first_user_turn() -> None:
    turn1 = [SYSTEM, {"role": "user", "content": "my order is late"}]
    turn2 = [*turn1, {"role": "assistant", "content": "sorry"}, {"role": "user", "content": "where is it?"}]
    other = [SYSTEM, {"role": "user", "content": "cancel my plan"}]
    assert chat_prefix_key(turn1) == chat_prefix_key(turn2)  # the same conversation
    assert chat_prefix_key(turn1) != chat_prefix_key(other)  # same system prompt, other conversation
    assert chat_prefix_key(turn1, tools=[{"type": "function"}]) != chat_prefix_key(turn1)
    assert chat_prefix_key([]) is None


def test_content_parts_and_developer_messages_count() -> None:
    a = [
        {"role": "developer", "content": [{"type": "text", "text": "rules"}]},
        {"role": "user", "content": "x"},
    ]
    b = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "x"}]
    assert chat_prefix_key(a) == chat_prefix_key(b)


def test_blocks_chain_so_shared_prefixes_share_leading_hashes() -> None:
    base = "x" * 64 * 3
    a = text_blocks(base + "a" * 64)
    b = text_blocks(base + "b" * 64)
    assert a[:3] == b[:3] and a[3] != b[3]
    assert text_blocks("short") == ()
    assert len(text_blocks("y" * 64 * 1000)) == 256  # bounded
    assert "system\nYou are" in render_messages([SYSTEM])


def test_block_hashes_fit_sixty_bits_and_use_them() -> None:
    # An index holds a replica's whole KV cache in these: CPython stores an int below 2**60 in
    # 32 bytes, a 64-bit one in 48.
    hashes = text_blocks("".join(f"{i:064d}" for i in range(256)))
    assert len(set(hashes)) == 256
    assert all(0 <= h < 1 << BLOCK_HASH_BITS for h in hashes) and BLOCK_HASH_BITS <= 60
    assert max(hashes).bit_length() > BLOCK_HASH_BITS - 4  # the bits are used, not masked away


def test_completion_keys() -> None:
    assert completion_prefix_key("abc" * 1000) == completion_prefix_key("abc" * 1000 + "tail")
    assert completion_prefix_key("") is None
    assert completion_prefix_key([1, 2, 3]) == completion_prefix_key([1, 2, 3])


def test_chat_view_is_the_size_key_and_blocks_the_gateway_routes_on() -> None:
    messages = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "é" * 100}]}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    view = chat_view(messages, tools)
    assert view.size == len(SYSTEM["content"]) + 200 + len(
        '[{"function": {"name": "f"}, "type": "function"}]'
    )
    assert view.prefix_key == chat_prefix_key(messages, tools)
    assert view.blocks == text_blocks(render_messages(messages)) and len(view.blocks) == 245 // 64
    assert chat_view(messages, tools, blocks=False).blocks == ()
    assert chat_view(messages, max_blocks=2).blocks == view.blocks[:2]
