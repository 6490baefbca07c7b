"""The KV-cache manager: prefix-cache lookups and slot allocation for requests.

The scheduler talks only to this class; it talks only to the :class:`BlockPool`. As in vLLM v1,
``allocate_slots`` returns ``None`` when the request does not fit, and that is the single
"cannot fit" signal the scheduler reacts to (by preempting, or by leaving a waiting request
where it is).

Block layout of one request when it is admitted::

    | < computed (prefix hit) > | < new: to be computed this step > |
    | touched, ref_cnt + 1      | fresh blocks from the free queue  |
    |          < cached as soon as a block is full and scheduled >   |

Example::

    kv = KVCacheManager(BlockPool(12), block_size=16, max_model_len=160)
    hit_blocks, hit_tokens = kv.get_computed_blocks(req)
    if kv.allocate_slots(req, req.num_tokens - hit_tokens, hit_tokens, hit_blocks) is None:
        ...  # does not fit now

With KV events on (the pool queues them and ``hasher`` is given), caching full blocks queues one
``BlockStored`` per call that caches new blocks, as vLLM's ``cache_full_blocks`` does: their
hashes in vLLM's scheme (:class:`~replicas.wire.kv_events.BlockHasher`, published as 64-bit
ints), the parent's, their token ids, the block size and the LoRA adapter. A trace request
(hashes without token ids) publishes its own hashes and no token ids.
"""

from __future__ import annotations

from tidal.replicas.sim.block_pool import BlockPool, KVCacheBlock
from tidal.replicas.sim.request import Request, RequestStatus
from tidal.replicas.wire.kv_events import MEDIUM_GPU, BlockHasher, BlockStored, external_hash

__all__ = ["KVCacheManager"]

_NO_BLOCKS: list[KVCacheBlock] = []


class KVCacheManager:
    """Allocation and prefix caching for one attention group (full attention, one block size)."""

    def __init__(
        self,
        block_pool: BlockPool,
        *,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
        hasher: BlockHasher | None = None,
    ) -> None:
        self.block_pool = block_pool
        self.hasher = hasher
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.watermark_blocks = int(watermark * block_pool.num_gpu_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix-cache map.
        self.num_cached_block: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request, and its token count.

        At most ``num_tokens - 1`` tokens may hit: the last token is always recomputed to get
        its logits (so a full-prompt hit recomputes a whole block, as in vLLM).
        """
        if not self.enable_caching or request.pooling:
            return _NO_BLOCKS, 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.ensure_block_hashes(max_blocks)
        cache = self.block_pool.cached_block_hash_to_block
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            hit = cache.get(hashes[i])
            if hit is None:
                break
            hits.append(hit if isinstance(hit, KVCacheBlock) else next(iter(hit.values())))
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        *,
        has_scheduled_reqs: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Reserve blocks for ``num_new_tokens`` more tokens; ``None`` when they do not fit.

        Prefix-hit blocks that are currently free count against the free blocks too, because
        touching them takes them out of the free queue.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        bs = self.block_size
        pool = self.block_pool
        rid = request.request_id
        computed = new_computed_blocks or _NO_BLOCKS
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed + num_new_tokens, self.max_model_len)
        req_blocks = self.req_to_blocks.get(rid)
        held = len(req_blocks) if req_blocks is not None else 0
        num_new_blocks = -(-num_tokens_need_slot // bs) - len(computed) - held
        if num_new_blocks < 0:
            num_new_blocks = 0
        num_evictable = 0
        for b in computed:
            if b.ref_cnt == 0:
                num_evictable += 1
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        if num_new_blocks + num_evictable + watermark > pool.free_block_queue.num_free_blocks:
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if computed:
            pool.touch(computed)
            req_blocks.extend(computed)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if new_blocks:
            req_blocks.extend(new_blocks)
        if self.enable_caching and not request.pooling:
            # Cache what will be computed by the end of this step (only full blocks).
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Put the request's full blocks up to ``num_tokens`` into the prefix-cache map."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        done = self.num_cached_block.get(rid, 0)
        if num_full <= done:
            return
        hashes = request.ensure_block_hashes(num_full)
        blocks = self.req_to_blocks[rid]
        pool = self.block_pool
        cache = pool.cached_block_hash_to_block
        first_new = -1
        for i in range(done, num_full):
            b = blocks[i]
            if b.block_hash is not None:
                continue  # a prefix hit: already cached
            if first_new < 0:
                first_new = i
            h = hashes[i]
            if h in cache:
                pool.cache_full_block(b, h)  # a duplicate: the map keeps both
            else:
                b.block_hash = h
                cache[h] = b
        self.num_cached_block[rid] = num_full
        if first_new >= 0 and pool.kv_event_queue is not None:
            self._stored(request, blocks, first_new, num_full)

    def _stored(self, request: Request, blocks: list[KVCacheBlock], first: int, end: int) -> None:
        """Queue the ``BlockStored`` of blocks ``[first, end)``, newly cached."""
        queue = self.block_pool.kv_event_queue
        assert queue is not None
        bs = self.block_size
        hasher = self.hasher
        ids: list[int] = []
        if hasher is not None and request.prompt_token_ids is not None:
            digests = request.ext_digests
            parent = digests[-1] if digests else None
            for i in range(len(digests), end):
                toks = request.token_ids(i * bs, (i + 1) * bs)
                parent = hasher.hash_block(parent, toks, request.hash_extra)
                digests.append(parent)
            ext = [external_hash(d) for d in digests[first:end]]
            parent_ext = external_hash(digests[first - 1]) if first > 0 else None
            ids = request.token_ids(first * bs, end * bs)
        else:
            ext = [h & 0xFFFF_FFFF_FFFF_FFFF for h in request.block_hashes[first:end]]
            parent_ext = request.block_hashes[first - 1] & 0xFFFF_FFFF_FFFF_FFFF if first > 0 else None
        for i, b in enumerate(blocks[first:end]):
            b.ext_hash = ext[i]
        n = end - first
        queue.append(
            BlockStored(
                block_hashes=list(ext),
                parent_block_hash=parent_ext,
                token_ids=ids,
                block_size=bs,
                lora_id=request.lora_id or None,
                medium=MEDIUM_GPU,
                lora_name=request.lora_name if request.lora_id else None,
                extra_keys=[(request.lora_name,) if request.lora_id else None] * n,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so the tail of a chain is evicted first."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, _NO_BLOCKS)]

    def num_blocks(self, request_id: str) -> int:
        blocks = self.req_to_blocks.get(request_id)
        return len(blocks) if blocks is not None else 0
