"""A request inside the simulated engine, in vLLM v1's shape.

There is no prefill or decode mode: a request has ``num_tokens`` (prompt plus the output so far)
and ``num_computed_tokens`` (how many of them have KV in the cache); each step the scheduler lets
the computed count catch up. A request is known either by its prompt token ids (the HTTP server,
tests) or only by its prompt length and chained block hashes (trace replay, where materialising
10^8 token ids would be wasteful).

Example::

    req = Request("r1", num_prompt_tokens=40, max_tokens=8, block_size=16,
                  prompt_token_ids=list(range(40)))
    req.block_hashes          # two full blocks hashed, chained through the parent
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

__all__ = ["NONE_HASH", "Request", "RequestStatus", "hash_block", "lora_seed"]

# The parent of a chain's first block (vLLM's NONE_HASH). Python hashes tuples of ints
# deterministically (only str/bytes hashing is salted per process), so block hashes are stable.
NONE_HASH = hash(("tidal-sim-none-hash", 0))


def lora_seed(lora_id: int) -> int:
    """The chain seed for requests of one LoRA adapter: its blocks never match the base model's."""
    return NONE_HASH if lora_id == 0 else hash((NONE_HASH, "lora", lora_id))


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: equal prefixes give equal hashes, block by block."""
    return hash((parent, *token_ids))


class RequestStatus(enum.IntEnum):
    """Lifecycle order matters: everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Note: anything after PREEMPTED is considered a finished status.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISHED_REASON_MAP.get(status)


_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation (or pooling) request.

    ``max_tokens`` is already capped by the context length; ``stop_after`` (if set) is where the
    simulated model ends its answer by itself (finish reason ``stop``). ``pooling`` requests only
    prefill: they finish when the prompt is computed, with no output token.
    """

    __slots__ = (
        "_output_salt",
        "arrival_time",
        "block_hashes",
        "block_size",
        "ext_digests",
        "first_scheduled_time",
        "first_token_time",
        "hash_extra",
        "last_token_time",
        "lora_id",
        "lora_name",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "pooling",
        "priority",
        "prompt_token_ids",
        "request_id",
        "status",
        "stop_after",
        "user_data",
    )

    def __init__(
        self,
        request_id: str,
        *,
        num_prompt_tokens: int,
        max_tokens: int,
        block_size: int,
        prompt_token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[int] | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        lora_id: int = 0,
        lora_name: str | None = None,
        stop_after: int | None = None,
        pooling: bool = False,
        output_salt: int | None = None,
    ) -> None:
        if num_prompt_tokens < 1:
            raise ValueError("a request needs at least one prompt token")
        if prompt_token_ids is not None and len(prompt_token_ids) != num_prompt_tokens:
            raise ValueError("num_prompt_tokens must equal len(prompt_token_ids)")
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = 0 if pooling else max_tokens
        self.stop_after = stop_after
        self.pooling = pooling
        self.block_size = block_size
        self.arrival_time = arrival_time
        self.priority = priority
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.user_data: object = None
        # KV events (when the engine publishes them): vLLM's block digests of this request, and
        # the extra keys vLLM hashes into every block (a LoRA's ("lora", name, path)).
        self.ext_digests: list[bytes] = []
        self.hash_extra: tuple[tuple[str, ...], ...] | None = None
        self.prompt_token_ids: list[int] | None = list(prompt_token_ids) if prompt_token_ids else None
        # Output token ids are kept only when the prompt is given as tokens (the HTTP server).
        self.output_token_ids: list[int] | None = [] if prompt_token_ids is not None else None
        self._output_salt = output_salt if output_salt is not None else hash((request_id, "out"))
        seed = lora_seed(lora_id)
        if block_hashes is not None:
            if len(block_hashes) != num_prompt_tokens // block_size:
                raise ValueError(
                    f"{len(block_hashes)} block hashes given for {num_prompt_tokens} prompt tokens "
                    f"(expected {num_prompt_tokens // block_size} full blocks of {block_size})"
                )
            hashes = list(block_hashes)
            if lora_id:
                # Re-seed the chain so an adapter's blocks never match the base model's.
                hashes = [hash((seed, h)) for h in hashes]
            self.block_hashes = hashes
        elif prompt_token_ids is not None:
            self.block_hashes = []
            parent = seed
            toks = self.prompt_token_ids
            assert toks is not None
            for start in range(0, num_prompt_tokens - block_size + 1, block_size):
                parent = hash((parent, *toks[start : start + block_size]))
                self.block_hashes.append(parent)
        else:
            raise ValueError("give either prompt_token_ids or block_hashes")

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def max_output_tokens(self) -> int:
        """How many tokens this request will produce in total (its natural stop or max_tokens)."""
        if self.stop_after is not None and self.stop_after < self.max_tokens:
            return self.stop_after
        return self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Prompt and output token ids ``[start, end)`` (empty for a trace request, whose ids are
        not materialised)."""
        prompt = self.prompt_token_ids
        out = self.output_token_ids
        if prompt is None or out is None:
            return []
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return out[start - n : end - n]
        return prompt[start:] + out[: end - n]

    def ensure_block_hashes(self, num_full_blocks: int) -> list[int]:
        """Hash the full blocks up to ``num_full_blocks`` (output blocks are hashed when they fill)."""
        hashes = self.block_hashes
        n = len(hashes)
        if n >= num_full_blocks:
            return hashes
        bs = self.block_size
        parent = hashes[-1] if hashes else lora_seed(self.lora_id)
        out = self.output_token_ids
        prompt = self.prompt_token_ids
        while n < num_full_blocks:
            if out is not None and prompt is not None:
                start = n * bs
                toks = (
                    (prompt + out)[start : start + bs]
                    if start < len(prompt)
                    else out[start - len(prompt) : start - len(prompt) + bs]
                )
                parent = hash((parent, *toks))
            else:
                # Trace replay: output tokens are not materialised; their blocks get hashes of
                # their own, unique to this request.
                parent = hash((parent, self._output_salt, n))
            hashes.append(parent)
            n += 1
        return hashes

    def __lt__(self, other: Request) -> bool:
        # The priority queue's order: smaller priority first, then earlier arrival.
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        return self.request_id < other.request_id

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, out={self.num_output_tokens}/{self.max_output_tokens})"
        )
