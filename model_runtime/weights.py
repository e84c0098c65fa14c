"""Load a Llama/Qwen2 checkpoint (safetensors) into per-rank fused tensors for tensor parallelism.

Sharding (rank r of tp): attention heads and MLP columns are split; the output and down
projections are split by rows of their input, so their partial outputs are all-reduced.

    qkv   : [ (H/tp + 2*KVH/tp) * D, hidden ]   rows of q, k, v for this rank's heads
    o     : [ hidden, H/tp * D ]                 columns for this rank's heads
    gate_up: [ 2 * I/tp, hidden ]                this rank's MLP columns
    down  : [ hidden, I/tp ]
Embedding, norms and lm_head are replicated.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from model_runtime.config import ModelConfig
from model_runtime.packed_weight import Packed, PackedBF16, PackedInt8
from model_runtime.quant_formats import UnsupportedQuantError
from model_runtime.quant_weights import QuantLinear, load_quant_linears


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor | Packed | QuantLinear  # packed for the AMX kernel where it runs (packed_weight.py), or q4
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | Packed | QuantLinear
    post_norm: torch.Tensor
    gate_up: torch.Tensor | Packed | QuantLinear
    down: torch.Tensor | Packed | QuantLinear


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor | Packed | QuantLinear


class _TensorSource:
    """Reads named tensors (or row/column slices of them) from one or more safetensors files."""

    def __init__(self, checkpoint_dir: Path) -> None:
        index = checkpoint_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [p.name for p in sorted(checkpoint_dir.glob("*.safetensors"))]
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {checkpoint_dir}")
        self._handles = [safe_open(str(checkpoint_dir / f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def rows(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        sl = self._where[name].get_slice(name)
        return sl[start:stop] if start is not None else sl[:]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._where[name].get_slice(name)[:, start:stop]


def load_weights(
    checkpoint_dir: str | Path, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1,
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> ModelWeights:
    config.check_tensor_parallel(tp_size)
    src = _TensorSource(Path(checkpoint_dir))
    d = config.head_dim
    hq, hkv = config.num_heads // tp_size, config.num_kv_heads // tp_size
    inter = config.intermediate_size // tp_size

    def cast(t: torch.Tensor) -> torch.Tensor:
        # copy=True: a whole-tensor read can alias the memory-mapped file; weights must own their memory
        # (an mmapped matrix is re-read from disk whenever the page cache is under pressure)
        return t.to(dtype=dtype, device=device, copy=True).contiguous()

    def head_rows(name: str, heads: int) -> torch.Tensor:
        return src.rows(name, tp_rank * heads * d, (tp_rank + 1) * heads * d)

    layers: list[LayerWeights] = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([
            head_rows(p + "self_attn.q_proj.weight", hq),
            head_rows(p + "self_attn.k_proj.weight", hkv),
            head_rows(p + "self_attn.v_proj.weight", hkv),
        ])
        bias = None
        if src.has(p + "self_attn.q_proj.bias"):
            bias = cast(torch.cat([
                head_rows(p + "self_attn.q_proj.bias", hq),
                head_rows(p + "self_attn.k_proj.bias", hkv),
                head_rows(p + "self_attn.v_proj.bias", hkv),
            ]))
        gate_up = torch.cat([
            src.rows(p + "mlp.gate_proj.weight", tp_rank * inter, (tp_rank + 1) * inter),
            src.rows(p + "mlp.up_proj.weight", tp_rank * inter, (tp_rank + 1) * inter),
        ])
        layers.append(LayerWeights(
            input_norm=cast(src.rows(p + "input_layernorm.weight")),
            qkv=cast(qkv),
            qkv_bias=bias,
            o=cast(src.cols(p + "self_attn.o_proj.weight", tp_rank * hq * d, (tp_rank + 1) * hq * d)),
            post_norm=cast(src.rows(p + "post_attention_layernorm.weight")),
            gate_up=cast(gate_up),
            down=cast(src.cols(p + "mlp.down_proj.weight", tp_rank * inter, (tp_rank + 1) * inter)),
        ))
    embed = cast(src.rows("model.embed_tokens.weight"))
    lm_head = cast(src.rows("lm_head.weight")) if src.has("lm_head.weight") else embed
    return ModelWeights(embed=embed, layers=layers, final_norm=cast(src.rows("model.norm.weight")), lm_head=lm_head)


def pack_weights(weights: ModelWeights, kind: type[PackedBF16] | type[PackedInt8] = PackedBF16) -> ModelWeights:
    """The same weights with every linear layer packed (one layer at a time, so peak memory grows by one
    layer's weights); norms, biases and the embedding stay tensors."""
    layers = []
    for i, lw in enumerate(weights.layers):
        layers.append(dataclasses.replace(
            lw, qkv=kind(lw.qkv), o=kind(lw.o), gate_up=kind(lw.gate_up), down=kind(lw.down)))
        weights.layers[i] = layers[-1]  # drop the unpacked tensors now
    return dataclasses.replace(weights, layers=layers, lm_head=kind(weights.lm_head))


def load_quant_weights(checkpoint_dir: str | Path, config: ModelConfig, module: object, tp_rank: int = 0,
                       tp_size: int = 1) -> ModelWeights:
    """`--dtype q4`: the linears in the GGUF's codes (model_runtime/quant_weights.py; the cached quant file must
    exist: prepare.prepare_quant), norms, biases and the embedding in float32 from the checkpoint."""
    if tp_size != 1:
        raise UnsupportedQuantError(f"--dtype q4 runs on one rank (tensor parallel size {tp_size} asked); use "
                                    "bfloat16 for a tensor-parallel verifier")
    src = _TensorSource(Path(checkpoint_dir))
    linears, lm_head = load_quant_linears(Path(checkpoint_dir), config, module)  # type: ignore[arg-type]

    def f32(name: str) -> torch.Tensor:
        return src.rows(name).to(dtype=torch.float32, copy=True).contiguous()

    layers = []
    for i, lin in enumerate(linears):
        p = f"model.layers.{i}."
        bias = None
        if src.has(p + "self_attn.q_proj.bias"):
            bias = torch.cat([f32(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        layers.append(LayerWeights(input_norm=f32(p + "input_layernorm.weight"), qkv=lin["qkv"], qkv_bias=bias,
                                   o=lin["o"], post_norm=f32(p + "post_attention_layernorm.weight"),
                                   gate_up=lin["gate_up"], down=lin["down"]))
    return ModelWeights(embed=f32("model.embed_tokens.weight"), layers=layers, final_norm=f32("model.norm.weight"),
                        lm_head=lm_head)
