"""ModelConfig: the architecture facts our forward pass needs, read from a Hugging Face config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama/Qwen2-family decoder this runtime implements."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v projections carry biases
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"model_type {self.model_type!r} unsupported; supported: {SUPPORTED_ARCHITECTURES}")
        assert self.num_heads % self.num_kv_heads == 0, "query heads must be a multiple of kv heads"

    def check_tensor_parallel(self, tp_size: int) -> None:
        if self.num_heads % tp_size or self.num_kv_heads % tp_size or self.intermediate_size % tp_size:
            raise UnsupportedModelError(
                f"tensor parallel size {tp_size} must divide heads ({self.num_heads}), kv heads "
                f"({self.num_kv_heads}) and the MLP width ({self.intermediate_size})"
            )

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "")
        rope = hf.get("rope_parameters") or {}
        rope_scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
        if rope_type != "default":
            raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported")
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, checkpoint_dir: str | Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((Path(checkpoint_dir) / "config.json").read_text()))


def eos_token_ids(checkpoint_dir: Path, config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """A checkpoint's end-of-sequence ids: its config's, its generation config's and its tokenizer's."""
    ids = set(config.eos_token_ids)
    gen_cfg = Path(checkpoint_dir) / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
