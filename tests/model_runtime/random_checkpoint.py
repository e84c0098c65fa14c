"""Tiny seeded random-weight checkpoints of the Llama and Qwen2 architectures, built in code.

Used by tests (parity, engine exactness) and saved as ordinary Hugging Face checkpoint dirs,
so our loader and transformers read the very same files.
"""

from __future__ import annotations

from pathlib import Path

import torch


def make_random_checkpoint(
    out_dir: str | Path, arch: str = "qwen2", seed: int = 0, vocab_size: int = 256, hidden_size: int = 64,
    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
    tie_word_embeddings: bool = True, init_std: float = 0.08,
) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out = Path(out_dir)
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings, initializer_range=init_std,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        config = Qwen2Config(rope_theta=10000.0, **common)
    elif arch == "llama":
        config = LlamaConfig(rope_theta=10000.0, attention_bias=False, **common)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # give biases and norms non-trivial values so parity tests exercise them
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, init_std)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
    model.save_pretrained(out)
    return out
