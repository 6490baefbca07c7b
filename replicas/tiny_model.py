"""Build a tiny random-weight Llama, its tokenizer and LoRA adapters, entirely offline.

Real vLLM on the CPU serves this model in tests and development: it exercises the real engine
(scheduler, paged KV, prefix cache, LoRA, metrics) at a size a laptop runs in milliseconds.

Layout written under ``out``::

    out/model/            config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    out/adapters/lora-0/  adapter_config.json, adapter_model.safetensors   (one per --adapters)

Needs the ``vllm`` extra (torch, transformers, tokenizers, peft).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.replicas.words import COMMON_WORDS

__all__ = ["CHAT_TEMPLATE", "TinyModelSpec", "build_tiny_model"]

# A minimal chat template in the ChatML style; vLLM renders it with jinja2.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. head_dim = hidden / heads must be at least 32 for vLLM's CPU kernels."""

    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    num_layers: int = 2
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_position_embeddings: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError("hidden_size / num_heads must be an integer of at least 32 (vLLM CPU attention)")


def _corpus() -> list[str]:
    # Deterministic English-ish text so the BPE merges are stable from build to build.
    words = COMMON_WORDS
    lines = []
    for i in range(4000):
        n = 6 + (i * 7) % 11
        lines.append(" ".join(words[(i * 31 + j * 17) % len(words)] for j in range(n)))
    return lines


def _optional(module: str) -> Any:
    # The `vllm` extra's heavy libraries are imported only here, untyped on purpose.
    return importlib.import_module(module)


def _build_tokenizer(out: Path, vocab_size: int) -> Any:
    tk = _optional("tokenizers")
    Tokenizer, decoders, models, pre_tokenizers, trainers = (
        tk.Tokenizer,
        tk.decoders,
        tk.models,
        tk.pre_tokenizers,
        tk.trainers,
    )
    PreTrainedTokenizerFast = _optional("transformers").PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def build_tiny_model(out: str | Path, *, adapters: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write the model (and ``adapters`` LoRA adapters) under ``out``; returns the model directory.

    Building is idempotent: an existing complete build with the same spec is reused.
    """
    torch = _optional("torch")
    transformers = _optional("transformers")
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM

    spec = spec or TinyModelSpec()
    root = Path(out)
    model_dir = root / "model"
    stamp = root / "build.json"
    want = {"spec": spec.__dict__, "adapters": adapters}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(spec.seed)
    tokenizer = _build_tokenizer(model_dir, spec.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(str(model_dir), safe_serialization=True)

    if adapters:
        peft = _optional("peft")
        LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

        for i in range(adapters):
            torch.manual_seed(spec.seed + 1000 + i)
            base = LlamaForCausalLM(config)
            lora = LoraConfig(
                r=8,
                lora_alpha=16,
                target_modules=["q_proj", "v_proj"],
                init_lora_weights=False,
                lora_dropout=0.0,
            )
            peft_model = get_peft_model(base, lora)
            adir = root / "adapters" / f"lora-{i}"
            peft_model.save_pretrained(str(adir))
            # vLLM resolves the base model from the adapter config; point it at our local build.
            cfg_path = adir / "adapter_config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["base_model_name_or_path"] = str(model_dir.resolve())
            cfg_path.write_text(json.dumps(cfg, indent=2))
    stamp.write_text(json.dumps(want))
    return model_dir


def adapter_dirs(out: str | Path) -> list[Path]:
    """The adapter directories of a build, in index order."""
    base = Path(out) / "adapters"
    return sorted(base.glob("lora-*"), key=lambda p: int(p.name.split("-")[1])) if base.exists() else []
