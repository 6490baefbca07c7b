"""Named replica configurations: a model, a GPU type, a tensor-parallel size and vLLM's defaults.

``tidal sim --list-presets`` prints them; ``tidal sim --preset NAME`` and
``VirtualCluster(preset=NAME)`` use them. Engine limits default to what vLLM's API server picks
on that hardware (H100/H200: ``max_num_seqs`` 1024, ``max_num_batched_tokens`` 8192) and can be
overridden per replica.

Example::

    p = get_preset("llama-3.1-70b-fp8-h200-tp4")
    p.num_gpu_blocks          # KV blocks of 16 tokens left after the FP8 weights
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from tidal.replicas.sim.cost import (
    CPU_TINY,
    E5_MISTRAL_7B,
    FAST_TEST_DEVICE,
    H100,
    H200,
    LLAMA_3_1_8B,
    LLAMA_3_1_70B,
    LLAMA_3_1_70B_FP8,
    TINY_LLAMA,
    CostModel,
    Device,
    Efficiency,
    ModelSpec,
)

__all__ = ["PRESETS", "Preset", "get_preset"]


@dataclass(frozen=True)
class Preset:
    """Everything that makes one simulated replica, except per-run overrides."""

    name: str
    description: str
    model: ModelSpec
    device: Device
    tp: int = 1
    block_size: int = 16
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.92
    num_gpu_blocks_override: int | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    eff: Efficiency = field(default_factory=Efficiency)

    @property
    def context_len(self) -> int:
        return self.max_model_len or self.model.max_model_len

    @cached_property
    def cost(self) -> CostModel:
        return CostModel(self.model, self.device, self.tp, self.eff)

    @cached_property
    def num_gpu_blocks(self) -> int:
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        return self.cost.num_kv_blocks(
            self.block_size, self.gpu_memory_utilization, self.max_num_batched_tokens
        )

    @property
    def is_embedding(self) -> bool:
        return self.model.pooling


_PRESETS = [
    Preset(
        "tiny-cpu",
        "the tiny random Llama of the tests on real vLLM's CPU backend (block 128, 8192 blocks)",
        TINY_LLAMA,
        CPU_TINY,
        block_size=128,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        num_gpu_blocks_override=8192,  # VLLM_CPU_KVCACHE_SPACE=1 GiB / (128 tokens x 1 KiB)
        max_loras=2,
        max_lora_rank=8,
    ),
    Preset(
        "llama-3.1-70b-fp8-h200-tp4",
        "Llama-3.1-70B, FP8 weights, BF16 KV, on 4 x H200 (tensor parallel)",
        LLAMA_3_1_70B_FP8,
        H200,
        tp=4,
    ),
    Preset(
        "llama-3.1-70b-fp8-h200-tp1",
        "Llama-3.1-70B, FP8 weights, BF16 KV, on 1 x H200 (the shape bench/device/ measures)",
        LLAMA_3_1_70B_FP8,
        H200,
    ),
    Preset(
        "llama-3.1-70b-fp8-h200-tp8",
        "Llama-3.1-70B, FP8 weights, BF16 KV, on 8 x H200 (tensor parallel)",
        LLAMA_3_1_70B_FP8,
        H200,
        tp=8,
    ),
    Preset(
        "llama-3.1-70b-bf16-h100-tp4",
        "Llama-3.1-70B, BF16 weights and KV, on 4 x H100 (tensor parallel)",
        LLAMA_3_1_70B,
        H100,
        tp=4,
    ),
    Preset("llama-3.1-8b-h100", "Llama-3.1-8B, BF16, on 1 x H100", LLAMA_3_1_8B, H100),
    Preset("llama-3.1-8b-h200", "Llama-3.1-8B, BF16, on 1 x H200", LLAMA_3_1_8B, H200),
    Preset(
        "e5-mistral-7b-h100",
        "e5-mistral-7b-instruct embedding model (pooling, /v1/embeddings), BF16, on 1 x H100",
        E5_MISTRAL_7B,
        H100,
        max_loras=0,
    ),
    Preset(
        "fast-test",
        "a Llama-3.1-8B shape on a fictitious device with ~1 ms steps, for benchmarking the serving path",
        LLAMA_3_1_8B,
        FAST_TEST_DEVICE,
        max_model_len=32768,
        num_gpu_blocks_override=65536,
    ),
]
PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``KeyError`` lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None
