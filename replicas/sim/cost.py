"""Roofline step-time model: how long one engine step takes on a given model and GPU.

One step runs the whole batch through the model once. Per GPU (tensor parallelism splits
weights, heads and KV evenly):

* **linear layers** read every weight once and do 2 FLOPs per weight per token:
  ``smooth_max(weight_bytes / (HBM_bw * bw_eff), linear_flops / (peak * mfu))`` -- memory-bound
  for small batches (decode), compute-bound for large ones (prefill); the p-norm ``smooth_max``
  reproduces the gradual knee measured on H100s (Vidur's per-operator profiles);
* **attention** reads each sequence's KV (decode: memory-bound) and does
  ``4 * heads * head_dim`` FLOPs per (query, key) pair (prefill: compute-bound);
* **tensor-parallel all-reduce**: two per layer, a ring's ``2(tp-1) * hop + 2(tp-1)/tp * bytes /
  link_bw``;
* **overheads**: per step (scheduling, sampling, launch), per layer (kernel launches that CUDA
  graphs do not hide), per sequence in the batch.

The efficiency constants are fitted once (``replicas/sim/calibrate.py``) against the published
points of ``reference/sim_traces.md`` and shared by every preset; no constant is fitted per point.

Example::

    cost = CostModel(LLAMA_3_1_70B_FP8, H200, tp=4)
    cost.step_time(num_tokens=8, num_seqs=8, num_sampled=8, kv_tokens=8 * 1000,
                   attention_pairs=8 * 1001)        # one decode step of batch 8, ~16 ms
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

__all__ = [
    "CPU_TINY",
    "DEVICES",
    "E5_MISTRAL_7B",
    "FAST_TEST_DEVICE",
    "H100",
    "H200",
    "LLAMA_3_1_8B",
    "LLAMA_3_1_70B",
    "LLAMA_3_1_70B_FP8",
    "MODELS",
    "TINY_LLAMA",
    "CostModel",
    "Device",
    "Efficiency",
    "ModelSpec",
    "StepCost",
]

GiB = 1024**3


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape and storage precision."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    weight_bytes_per_param: float = 2.0  # 1.0 for FP8 linear layers
    embed_bytes_per_param: float = 2.0  # embeddings and LM head stay in BF16 in FP8 checkpoints
    kv_bytes_per_elem: float = 2.0  # 1.0 with --kv-cache-dtype fp8
    pooling: bool = False  # an embedding model: no LM head, no output tokens

    @property
    def linear_params_per_layer(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def linear_params(self) -> int:
        return self.num_layers * self.linear_params_per_layer

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.pooling else 2)

    @property
    def weight_bytes(self) -> float:
        return (
            self.linear_params * self.weight_bytes_per_param + self.embed_params * self.embed_bytes_per_param
        )

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token, whole model (divide by tp for one GPU)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem

    def with_kv_dtype(self, kv_bytes_per_elem: float) -> ModelSpec:
        return replace(self, kv_bytes_per_elem=kv_bytes_per_elem)


@dataclass(frozen=True)
class Device:
    """One accelerator: datasheet numbers plus its fitted efficiencies."""

    name: str
    memory_bytes: float
    hbm_bandwidth: float  # B/s
    peak_flops_bf16: float  # dense tensor FLOP/s
    peak_flops_fp8: float
    link_bandwidth: float  # NVLink, B/s per direction
    bw_efficiency: float  # achieved / datasheet HBM bandwidth when streaming weights or KV
    # Non-torch memory (CUDA context, graphs, allocator slack) vLLM cannot give to the KV cache.
    reserved_bytes: float = 2.0 * GiB
    # Per-device overheads for devices outside the shared GPU fit (the CPU, the test device).
    step_overhead_s: float | None = None
    layer_overhead_s: float | None = None
    seq_overhead_s: float | None = None


@dataclass(frozen=True)
class Efficiency:
    """The constants fitted once, shared by all GPU presets (see calibrate.py).

    Fitted with ``python -m tidal.replicas.sim.calibrate --fit`` (Nelder-Mead on the squared log
    error of every calibration point that is not a documented exception), then rounded.
    """

    mfu_bf16: float = 0.80  # fraction of dense BF16 peak reached by the large GEMMs of a prefill
    mfu_fp8: float = 0.48  # fraction of dense FP8 peak (FP8 GEMMs reach a smaller fraction)
    mfu_attention: float = 0.80  # flash attention on prefills, fraction of BF16 peak
    knee: float = 4.0  # p of the p-norm smooth max at the memory/compute knee (not fitted)
    step_overhead_s: float = 1.06e-3  # scheduler, sampling, input preparation, launch
    layer_overhead_s: float = 53e-6  # per layer per step: norms, rotary, small kernels
    seq_overhead_s: float = 0.2e-6  # per sequence in the batch per step
    allreduce_hop_s: float = 1.48e-6  # latency per ring hop: an all-reduce on tp GPUs takes 2(tp-1) hops
    allreduce_bw_efficiency: float = 0.95  # achieved / NVLink bandwidth for large all-reduces


# -- datasheets ---------------------------------------------------------------------------------
# H100 SXM: 80 GiB HBM3 at 3.35 TB/s; H200 SXM: 141 GB (143,771 MiB) HBM3e at 4.8 TB/s; both the
# GH100 die: 989 TFLOP/s dense BF16, 1,979 FP8; NVLink 900 GB/s bidirectional (450 per direction).
H100 = Device("H100-SXM", 80 * GiB, 3.35e12, 989e12, 1979e12, 450e9, bw_efficiency=0.881)
H200 = Device("H200-SXM", 143771 * 1024**2, 4.8e12, 989e12, 1979e12, 450e9, bw_efficiency=0.862)
# The 2-core CPU that runs the real tiny vLLM in tests: about 1 ms per step whatever the batch.
CPU_TINY = Device(
    "cpu",
    32 * GiB,
    20e9,
    0.2e12,
    0.2e12,
    0.0,
    bw_efficiency=1.0,
    reserved_bytes=0.0,
    step_overhead_s=0.8e-3,
    layer_overhead_s=50e-6,
    seq_overhead_s=10e-6,
)
# A fictitious fast device for benchmarks of the serving path itself: 1-2 ms steps.
FAST_TEST_DEVICE = Device(
    "fast-test",
    80 * GiB,
    1e15,
    1e17,
    1e17,
    1e12,
    bw_efficiency=1.0,
    step_overhead_s=1.0e-3,
    layer_overhead_s=0.0,
    seq_overhead_s=4e-6,
)
DEVICES = {d.name: d for d in (H100, H200, CPU_TINY, FAST_TEST_DEVICE)}

# -- models (config.json shapes) ----------------------------------------------------------------
LLAMA_3_1_70B = ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, 131072)
LLAMA_3_1_70B_FP8 = replace(LLAMA_3_1_70B, name="llama-3.1-70b-fp8", weight_bytes_per_param=1.0)
LLAMA_3_1_8B = ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 131072)
E5_MISTRAL_7B = ModelSpec("e5-mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000, 32768, pooling=True)
# The tiny random Llama of replicas/tiny_model.py (hidden 256, 4 heads, 2 KV heads, 2 layers).
TINY_LLAMA = ModelSpec("tiny", 2, 256, 4, 2, 64, 512, 2051, 4096)
MODELS = {m.name: m for m in (LLAMA_3_1_70B, LLAMA_3_1_70B_FP8, LLAMA_3_1_8B, E5_MISTRAL_7B, TINY_LLAMA)}


@dataclass(frozen=True)
class StepCost:
    """One step's modelled time and the work behind it (for vLLM's MFU counters)."""

    seconds: float
    flops: float  # per GPU
    read_bytes: float  # per GPU
    write_bytes: float  # per GPU


@dataclass
class CostModel:
    """Step time of one model on ``tp`` devices; see the module docstring for the terms."""

    model: ModelSpec
    device: Device
    tp: int = 1
    eff: Efficiency = field(default_factory=Efficiency)

    def __post_init__(self) -> None:
        m, d, e, tp = self.model, self.device, self.eff, self.tp
        if tp < 1 or m.num_heads % tp or (m.num_kv_heads % tp and tp % m.num_kv_heads):
            raise ValueError(f"tensor parallel size {tp} does not divide {m.name}'s heads")
        fp8 = m.weight_bytes_per_param < 2
        peak_lin = (d.peak_flops_fp8 * e.mfu_fp8) if fp8 else (d.peak_flops_bf16 * e.mfu_bf16)
        bw = d.hbm_bandwidth * d.bw_efficiency
        kv_heads_per_gpu = max(1, m.num_kv_heads // tp)
        # Per-GPU constants, so step_time is a handful of multiply-adds.
        self._weight_s = (m.weight_bytes / tp) / bw
        self._weight_bytes = m.weight_bytes / tp
        self._lin_flops_per_token = 2.0 * m.linear_params / tp
        self._head_flops_per_sample = 0.0 if m.pooling else 2.0 * m.vocab_size * m.hidden_size / tp
        self._s_per_lin_flop = 1.0 / peak_lin
        self._kv_bytes_per_token = 2 * m.num_layers * kv_heads_per_gpu * m.head_dim * m.kv_bytes_per_elem
        self._s_per_kv_byte = 1.0 / bw
        self._attn_flops_per_pair = 4.0 * m.num_layers * (m.num_heads // tp) * m.head_dim
        self._s_per_attn_flop = 1.0 / (d.peak_flops_bf16 * e.mfu_attention)
        self._p = e.knee
        step_o = d.step_overhead_s if d.step_overhead_s is not None else e.step_overhead_s
        layer_o = d.layer_overhead_s if d.layer_overhead_s is not None else e.layer_overhead_s
        self._fixed_s = step_o + m.num_layers * layer_o
        self._seq_s = d.seq_overhead_s if d.seq_overhead_s is not None else e.seq_overhead_s
        if tp > 1:
            n_ar = 2 * m.num_layers
            self._ar_fixed_s = n_ar * e.allreduce_hop_s * 2 * (tp - 1)
            ar_bytes_per_token = m.hidden_size * 2 * 2 * (tp - 1) / tp  # BF16 activations, ring
            self._ar_s_per_token = n_ar * ar_bytes_per_token / (d.link_bandwidth * e.allreduce_bw_efficiency)
        else:
            self._ar_fixed_s = self._ar_s_per_token = 0.0

    # -- capacity ------------------------------------------------------------------------------

    def kv_bytes_per_token_per_gpu(self) -> float:
        return self._kv_bytes_per_token

    def num_kv_blocks(
        self, block_size: int, gpu_memory_utilization: float = 0.92, max_num_batched_tokens: int = 8192
    ) -> int:
        """KV blocks that fit in what vLLM leaves after weights, activations and reserved memory."""
        m = self.model
        activations = max_num_batched_tokens * (4 * m.hidden_size + 2 * m.intermediate_size // self.tp) * 2
        free = (
            self.device.memory_bytes * gpu_memory_utilization
            - self._weight_bytes
            - activations
            - self.device.reserved_bytes
        )
        blocks = int(free // (self._kv_bytes_per_token * block_size))
        if blocks < 2:
            raise ValueError(
                f"{m.name} on {self.tp} x {self.device.name} leaves no memory for the KV cache "
                f"({free / GiB:.1f} GiB)"
            )
        return blocks

    # -- time ----------------------------------------------------------------------------------

    def step_time(
        self, num_tokens: int, num_seqs: int, num_sampled: int, kv_tokens: int, attention_pairs: int
    ) -> float:
        """Seconds for one step that computes ``num_tokens`` tokens of ``num_seqs`` sequences.

        ``kv_tokens``: prior tokens whose KV the batch reads; ``attention_pairs``: (query, key)
        pairs attended; ``num_sampled``: sequences that sample a token (LM head rows).
        """
        if num_tokens <= 0:
            return 0.0
        p = self._p
        mem = self._weight_s
        comp = num_tokens * self._lin_flops_per_token * self._s_per_lin_flop
        comp += num_sampled * self._head_flops_per_sample * self._s_per_lin_flop
        lin = math.pow(math.pow(mem, p) + math.pow(comp, p), 1.0 / p)
        attn = (kv_tokens + num_tokens) * self._kv_bytes_per_token * self._s_per_kv_byte
        attn += attention_pairs * self._attn_flops_per_pair * self._s_per_attn_flop
        return (
            lin
            + attn
            + self._ar_fixed_s
            + num_tokens * self._ar_s_per_token
            + self._fixed_s
            + num_seqs * self._seq_s
        )

    def step_cost(
        self, num_tokens: int, num_seqs: int, num_sampled: int, kv_tokens: int, attention_pairs: int
    ) -> StepCost:
        """``step_time`` plus the FLOPs and bytes behind it (per GPU)."""
        t = self.step_time(num_tokens, num_seqs, num_sampled, kv_tokens, attention_pairs)
        flops = (
            num_tokens * self._lin_flops_per_token
            + num_sampled * self._head_flops_per_sample
            + attention_pairs * self._attn_flops_per_pair
        )
        read = self._weight_bytes + kv_tokens * self._kv_bytes_per_token
        write = num_tokens * self._kv_bytes_per_token
        return StepCost(t, flops, read, write)

    def decode_terms(self, batch: int) -> tuple[float, float]:
        """A decode step of ``batch`` sequences takes ``a + s * context_tokens``: returns (a, s).

        Only the KV read and the attention FLOPs grow with the context, both linearly; this is
        what lets the virtual-time runner apply a run of decode steps in closed form.
        """
        a = self.step_time(batch, batch, batch, 0, batch)
        s = self._kv_bytes_per_token * self._s_per_kv_byte + self._attn_flops_per_pair * self._s_per_attn_flop
        return a, s

    def decode_run_work(self, batch: int, context_tokens: int, steps: int) -> tuple[float, float, float]:
        """FLOPs, read and written bytes (per GPU) of ``steps`` decode steps from ``context_tokens``."""
        # Context grows by `batch` per step: sum over steps of the context read.
        ctx_sum = steps * context_tokens + batch * steps * (steps - 1) / 2
        flops = steps * batch * (self._lin_flops_per_token + self._head_flops_per_sample)
        flops += (ctx_sum + steps * batch) * self._attn_flops_per_pair
        read = steps * self._weight_bytes + ctx_sum * self._kv_bytes_per_token
        write = steps * batch * self._kv_bytes_per_token
        return flops, read, write

    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        """A pure decode step: ``batch`` sequences holding ``context_tokens`` tokens in all."""
        return self.step_time(batch, batch, batch, context_tokens, context_tokens + batch)

    def prefill_time(self, prompt_tokens: int) -> float:
        """One whole prompt in one step (no chunking), for quick estimates."""
        n = prompt_tokens
        return self.step_time(n, 1, 1, 0, n * (n + 1) // 2)
