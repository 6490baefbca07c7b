"""``tidal bench kv-keys``: what the exact KV index costs the gateway per request.

For chat prompts of about 1k, 4k and 16k tokens, with the simulator's tokenizer and (with
``--tokenizer DIR``, or the test suite's tiny model when it is built) a real ``tokenizer.json``
with its chat template, it times on one core:

* ``tokenize_us`` -- the chat template and the tokenizer, for a prompt seen for the first time
  (what the replica does too);
* ``warm_tokenize_us`` -- the same through the gateway's segment cache
  (:class:`router.kv_events.PromptTokenizer`) when only the last user turn is new: the shared
  system prompt (or a conversation's earlier turns) is not tokenised again;
* ``keys_us`` -- the content keys of the prompt's blocks (:func:`router.kv_events.chain_keys`);
* ``vllm_hash_us`` -- vLLM's own block hashes of the same blocks (SHA-256 of the pickled
  tuple), which a gateway keyed by engine hashes would compute instead;
* ``lookup_us`` -- one candidate's match in its index (every block cached: the longest walk);
* ``match8_us`` -- the matches of 8 candidates holding 1/8, 2/8, ... 8/8 of the prompt, as the
  ``kv-index`` makes them (:meth:`router.kv_events.ReplicaBlockIndex.leading_shared`: one pass
  over the prompt through the pool's holders), against ``match8_scans_us``, the baseline in the
  same run: each candidate's own index walked in turn;
* ``estimate_us`` -- the baseline in the same run: the 64-character text blocks the estimate
  hashes today (:func:`router.prefix.text_blocks`);
* ``apply_us`` -- applying one ``BlockStored`` of the prompt's blocks to an index (per event
  batch, off the request path).

Per request the gateway pays ``tokenize + keys`` once (only when a candidate publishes events
and holds blocks) and ``match8`` per 8 candidates; ``per_request_us`` is the first-time cost,
``warm_request_us`` the cost with a cached system prompt. ``--quick`` times fewer repetitions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tidal.replicas.sim.tokenizer import HFTokenizer, SimTokenizer, WordTokenizer
from tidal.replicas.wire.kv_events import BlockHasher, BlockStored, KVEventBatch
from tidal.router.kv_events import BlockHolders, PromptTokenizer, ReplicaBlockIndex, chain_keys
from tidal.router.prefix import render_messages, text_blocks

__all__ = ["run"]

_SENTENCE = "Please check the order history of the customer and answer politely with the tracking details. "


def _timed(fn: Callable[[], object], reps: int) -> float:
    """Median microseconds of ``fn`` over ``reps`` runs."""
    fn()  # warm caches (the tokenizer's piece cache, as in a running gateway)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def _tokenize(tok: SimTokenizer, msgs: list[dict[str, str]]) -> list[int]:
    return tok.encode(tok.render_chat(msgs))


class _NewTurn:
    """Each call: the cached system prompt plus a user turn never seen before."""

    def __init__(self, tok: PromptTokenizer, msgs: list[dict[str, str]]) -> None:
        self.tok = tok
        self.system = msgs[0]
        self.n = 0
        tok.chat_ids(msgs)  # the system prompt's piece is cached from here on

    def __call__(self) -> list[int]:
        self.n += 1
        return self.tok.chat_ids([self.system, {"role": "user", "content": f"Where is order {self.n}?"}])


def _estimate(msgs: list[dict[str, str]]) -> tuple[int, ...]:
    return text_blocks(render_messages(msgs))


def _apply(batch: KVEventBatch) -> None:
    index = ReplicaBlockIndex()
    index.reset(complete=True)
    index.apply(batch)


def _pool(ids: list[int], bs: int, n: int, candidates: int = 8) -> list[ReplicaBlockIndex]:
    """``candidates`` indexes sharing one pool's holders; the i-th holds the first (i + 1) /
    ``candidates`` of the prompt's ``n`` blocks."""
    holders = BlockHolders()
    pool = []
    for i in range(candidates):
        held = n * (i + 1) // candidates
        idx = ReplicaBlockIndex()
        idx.reset(complete=True)
        idx.share(holders, holders.bit(f"r{i}"))
        idx.apply(_stored(ids, bs, held))
        pool.append(idx)
    return pool


def _stored(ids: list[int], bs: int, n: int) -> KVEventBatch:
    """One batch storing the first ``n`` blocks of ``ids`` (block hashes 1 to ``n``)."""
    event = BlockStored(
        block_hashes=list(range(1, n + 1)),
        parent_block_hash=None,
        token_ids=ids[: n * bs],
        block_size=bs,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return KVEventBatch(0.0, [event], 0)


def _match_shared(pool: list[ReplicaBlockIndex], keys: tuple[int, ...]) -> list[int]:
    memo: dict[int, tuple[Sequence[int], Callable[[int], int]]] = {}  # one per request
    return [idx.leading_shared(keys, memo) for idx in pool]


def _match_scans(pool: list[ReplicaBlockIndex], keys: tuple[int, ...]) -> list[int]:
    return [idx.leading(keys) for idx in pool]


def _messages(target_tokens: int, tok: SimTokenizer) -> list[dict[str, str]]:
    per = max(1, len(tok.encode(_SENTENCE)))
    system = _SENTENCE * max(1, target_tokens // per)
    return [{"role": "system", "content": system}, {"role": "user", "content": "Where is order 4417?"}]


def _tokenizers(path: str | None) -> list[tuple[str, SimTokenizer]]:
    out: list[tuple[str, SimTokenizer]] = [("sim", WordTokenizer())]
    if path is None:
        cache = (
            Path(os.environ.get("TIDAL_TEST_CACHE", Path.home() / ".cache" / "tidal-tests"))
            / "tiny"
            / "model"
        )
        path = str(cache) if (cache / "tokenizer.json").is_file() else None
    if path is not None:
        # Without the `tokenizer` extra installed: the simulator's tokenizer only.
        with contextlib.suppress(ImportError):
            out.append((f"hf:{Path(path).name}", HFTokenizer(path)))
    return out


def run(quick: bool, out_dir: Path, tokenizer: str | None = None) -> list[dict[str, Any]]:
    """Rows per tokenizer, prompt size and block size; ``tokenizer`` is a Hugging Face tokenizer
    directory (default: the test suite's tiny model when it was built)."""
    reps = 20 if quick else 200
    hasher = BlockHasher("sha256")
    rows: list[dict[str, Any]] = []
    for tname, tok in _tokenizers(tokenizer):
        for target in (1024, 4096, 16384):
            msgs = _messages(target, tok)
            text = tok.render_chat(msgs)
            ids = tok.encode(text)
            for bs in (16, 128):
                n = (len(ids) - 1) // bs
                keys = chain_keys(ids, bs, limit=n)
                idx = ReplicaBlockIndex()
                idx.reset(complete=True)
                batch = _stored(ids, bs, n)
                idx.apply(batch)
                assert idx.leading(keys) == n
                pool = _pool(ids, bs, n)
                assert (
                    _match_shared(pool, keys)
                    == _match_scans(pool, keys)
                    == [n * (i + 1) // 8 for i in range(8)]
                )

                row: dict[str, Any] = {
                    "tokenizer": tname,
                    "prompt_tokens": len(ids),
                    "block": bs,
                    "blocks": n,
                    "tokenize_us": _timed(functools.partial(_tokenize, tok, msgs), reps),
                    "warm_tokenize_us": _timed(_NewTurn(PromptTokenizer(tok), msgs), reps),
                    "keys_us": _timed(functools.partial(chain_keys, ids, bs, limit=n), reps),
                    "vllm_hash_us": _timed(functools.partial(hasher.chain, ids, bs, limit=n), reps),
                    "lookup_us": _timed(functools.partial(idx.leading, keys), reps),
                    "match8_us": _timed(functools.partial(_match_shared, pool, keys), reps),
                    "match8_scans_us": _timed(functools.partial(_match_scans, pool, keys), reps),
                    "estimate_us": _timed(functools.partial(_estimate, msgs), reps),
                    "apply_us": _timed(functools.partial(_apply, batch), max(5, reps // 4)),
                }
                row["per_request_us"] = row["tokenize_us"] + row["keys_us"]
                row["warm_request_us"] = row["warm_tokenize_us"] + row["keys_us"]
                rows.append(row)
    from tidal.cli.bench import print_table

    print_table(
        rows,
        [
            "tokenizer",
            "prompt_tokens",
            "block",
            "tokenize_us",
            "warm_tokenize_us",
            "keys_us",
            "vllm_hash_us",
            "lookup_us",
            "match8_us",
            "match8_scans_us",
            "estimate_us",
            "per_request_us",
            "warm_request_us",
            "apply_us",
        ],
    )
    return rows
