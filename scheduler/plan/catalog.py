"""Models, GPUs and prices as data: the tables ``tidal plan`` reads, and the replicas they make.

The shipped tables are ``catalog.yaml`` (model shapes, GPU datasheets) and ``prices.yaml``
(**example** prices) beside this module; ``--catalog FILE`` adds or replaces entries and
``--prices FILE`` replaces the prices. A :class:`Catalog` turns a model, a GPU, a precision and
a tensor-parallel size into the simulator's :class:`~replicas.sim.presets.Preset` (cost model,
KV blocks), so a plan runs on exactly what ``tidal sim`` and the virtual cluster run.

Example::

    cat = load_catalog()
    preset = cat.preset("llama-3.1-70b", "h200", tp=4, weights="fp8", kv_dtype="bf16")
    preset.num_gpu_blocks * preset.block_size     # KV tokens of one replica
    cat.kv_bytes_per_token("llama-3.1-70b", "bf16")   # 327,680
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tidal.replicas.sim.cost import Device, ModelSpec
from tidal.replicas.sim.presets import Preset

__all__ = [
    "DEFAULT_CATALOG",
    "DEFAULT_PRICES",
    "Catalog",
    "CatalogError",
    "Dtype",
    "GpuEntry",
    "ModelEntry",
    "Prices",
    "load_catalog",
    "load_prices",
]

Dtype = Literal["bf16", "fp8"]
DEFAULT_CATALOG = Path(__file__).with_name("catalog.yaml")
DEFAULT_PRICES = Path(__file__).with_name("prices.yaml")
_MAX_FILE_BYTES = 1024 * 1024
_MIB = 1024**2


class CatalogError(ValueError):
    """A catalog or prices file that cannot be used, or a name it does not hold."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelEntry(_Strict):
    """A decoder-only transformer's shape (its ``config.json``)."""

    layers: int = Field(ge=1, le=1000)
    hidden_size: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    max_model_len: int = Field(ge=2)
    default_tp: list[int] = Field(default_factory=lambda: [1])
    aliases: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> ModelEntry:
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        if not self.default_tp or any(t < 1 for t in self.default_tp):
            raise ValueError("default_tp must list tensor-parallel sizes >= 1")
        return self


class GpuEntry(_Strict):
    """One accelerator's datasheet numbers, its achieved HBM bandwidth fraction and its node."""

    name: str = Field(min_length=1, max_length=100)
    memory_mib: float = Field(gt=0)
    hbm_tb_s: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    fp8_tflops: float = Field(gt=0)
    nvlink_gb_s: float = Field(gt=0)  # per direction
    bw_efficiency: float = Field(default=0.86, gt=0, le=1)
    reserved_gib: float = Field(default=2.0, ge=0)
    gpus_per_node: int = Field(default=8, ge=1, le=64)
    calibrated: bool = False
    aliases: list[str] = Field(default_factory=list)

    def device(self) -> Device:
        return Device(
            self.name,
            self.memory_mib * _MIB,
            self.hbm_tb_s * 1e12,
            self.bf16_tflops * 1e12,
            self.fp8_tflops * 1e12,
            self.nvlink_gb_s * 1e9,
            bw_efficiency=self.bw_efficiency,
            reserved_bytes=self.reserved_gib * 1024**3,
        )


class _CatalogFile(_Strict):
    models: dict[str, ModelEntry] = Field(default_factory=dict)
    gpus: dict[str, GpuEntry] = Field(default_factory=dict)


class _GpuPrice(_Strict):
    reserved: float = Field(gt=0)
    on_demand: float = Field(gt=0)
    spot: float = Field(gt=0)


class _ApiPrice(_Strict):
    input: float = Field(ge=0)
    output: float = Field(ge=0)


class Prices(_Strict):
    """GPU-hour prices per GPU type and an external API's price per million tokens per model."""

    example: bool = False
    currency: str = Field(default="USD", max_length=10)
    gpu_hour: dict[str, _GpuPrice] = Field(default_factory=dict)
    external_api: dict[str, _ApiPrice] = Field(default_factory=dict)

    def gpu(self, gpu: str) -> _GpuPrice:
        try:
            return self.gpu_hour[gpu]
        except KeyError:
            raise CatalogError(
                f"no GPU-hour price for {gpu!r} (prices for: {', '.join(self.gpu_hour)})"
            ) from None

    def api(self, model: str) -> _ApiPrice | None:
        return self.external_api.get(model)


def _read(path: Path) -> Any:
    try:
        size = path.stat().st_size
        if size > _MAX_FILE_BYTES:
            raise CatalogError(f"{path}: {size} bytes, more than {_MAX_FILE_BYTES}")
        text = path.read_text()
    except OSError as exc:
        raise CatalogError(f"{path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise CatalogError(f"{path}: not YAML/JSON: {exc}") from None


def _errors(path: Path, exc: ValidationError) -> CatalogError:
    msgs = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
    return CatalogError(f"{path}: {msgs}")


class Catalog:
    """Models and GPUs by name (or alias); see the module docstring."""

    def __init__(self, models: dict[str, ModelEntry], gpus: dict[str, GpuEntry]) -> None:
        self.models = models
        self.gpus = gpus

    @staticmethod
    def _find(table: dict[str, Any], name: str, what: str) -> str:
        key = name.strip().lower()
        for k, v in table.items():
            if key == k.lower() or key in (a.lower() for a in v.aliases):
                return k
        raise CatalogError(
            f"unknown {what} {name!r} (known: {', '.join(table)}; add one with --catalog FILE)"
        )

    def model_name(self, name: str) -> str:
        return self._find(self.models, name, "model")

    def gpu_name(self, name: str) -> str:
        return self._find(self.gpus, name, "GPU")

    def model_spec(self, model: str, weights: Dtype = "bf16", kv_dtype: Dtype = "bf16") -> ModelSpec:
        key = self.model_name(model)
        m = self.models[key]
        suffix = ("-fp8" if weights == "fp8" else "") + ("-kvfp8" if kv_dtype == "fp8" else "")
        return ModelSpec(
            key + suffix,
            m.layers,
            m.hidden_size,
            m.heads,
            m.kv_heads,
            m.head_dim,
            m.intermediate_size,
            m.vocab_size,
            m.max_model_len,
            weight_bytes_per_param=1.0 if weights == "fp8" else 2.0,
            kv_bytes_per_elem=1.0 if kv_dtype == "fp8" else 2.0,
        )

    def kv_bytes_per_token(self, model: str, kv_dtype: Dtype = "bf16") -> int:
        """K and V of every layer for one token: layers x KV heads x head dim x 2 x bytes."""
        return int(self.model_spec(model, "bf16", kv_dtype).kv_bytes_per_token)

    def preset(
        self,
        model: str,
        gpu: str,
        *,
        tp: int,
        weights: Dtype = "bf16",
        kv_dtype: Dtype = "bf16",
        max_num_seqs: int = 1024,
        max_num_batched_tokens: int = 8192,
    ) -> Preset:
        """One replica: ``tp`` GPUs serving the model. Raises :class:`CatalogError` when it does not fit."""
        spec = self.model_spec(model, weights, kv_dtype)
        g = self.gpus[self.gpu_name(gpu)]
        name = f"{spec.name}-{self.gpu_name(gpu)}-tp{tp}"
        base = Preset(
            name,
            f"{spec.name} on {tp} x {g.name} (plan)",
            spec,
            g.device(),
            tp=tp,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        try:
            blocks = base.num_gpu_blocks
        except ValueError as exc:  # CostModel: heads not divisible, or no memory left for KV
            raise CatalogError(str(exc)) from None
        # Like vLLM, the context length is the model's unless the KV cache holds less.
        context = min(spec.max_model_len, (blocks - 1) * base.block_size)
        if context < 256:
            raise CatalogError(f"{name}: the KV cache holds only {context} tokens")
        return Preset(
            name,
            base.description,
            spec,
            base.device,
            tp=tp,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=context,
        )


def load_catalog(extra: Path | None = None) -> Catalog:
    """The shipped catalog, with the entries of ``extra`` added (same names replace shipped ones)."""
    models: dict[str, ModelEntry] = {}
    gpus: dict[str, GpuEntry] = {}
    for path in [DEFAULT_CATALOG] + ([Path(extra)] if extra else []):
        try:
            parsed = _CatalogFile.model_validate(_read(path) or {})
        except ValidationError as exc:
            raise _errors(path, exc) from None
        models.update(parsed.models)
        gpus.update(parsed.gpus)
    return Catalog(models, gpus)


def load_prices(path: Path | None = None) -> tuple[Prices, Path]:
    """The prices at ``path`` (default: the shipped example prices) and where they came from."""
    p = Path(path) if path else DEFAULT_PRICES
    try:
        return Prices.model_validate(_read(p) or {}), p
    except ValidationError as exc:
        raise _errors(p, exc) from None
