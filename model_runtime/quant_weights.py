"""`--dtype q4`: the GGUF's own quantized linears, run by kernels/quant_linear.cpp (model_runtime/quant_kernels.py).

The GGUF is the model as shipped: its 4-bit (and 5/6/8-bit) codes are the weights, and the float32 or bfloat16
checkpoints are approximations of them (float32 exactly their values, bfloat16 rounded once more). Here every
linear keeps the GGUF's codes and scales (quant_formats.py: lossless), packed once into the kernel's layout and
cached beside the float32 checkpoint as `quant-v3.safetensors` (prepare.prepare_quant). Norms, biases and the
embedding table come from the float32 checkpoint, whose values are the GGUF's dequantized (transformers').

Activations, norms, attention and the KV cache are float32 (the portable kernels, batch-invariant); a linear
quantizes each activation row to int8 per superblock, as llama.cpp does, so a row's result never depends on the
rows around it and greedy speculative output equals plain q4 decoding.

A linear is one or more parts along its outputs (the fused q|k|v of Qwen2.5's Q4_K_M mixes Q4_K and Q6_K rows):
adjacent tensors of one format are packed as one part.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from model_runtime.config import ModelConfig
from model_runtime.quant_formats import Affine, UnsupportedQuantError, to_affine
from model_runtime.quant_pack import pack, unpack
from model_runtime.weights_convert import fsync_path

QUANT_FILE = "quant-v3.safetensors"  # v3: Q6_K's high bits as crumbs (quant_pack.py)
LINEARS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
           "down": ("ffn_down",)}


@dataclass(frozen=True)
class Part:
    packed: torch.Tensor  # uint8, kernels/quant_linear.cpp's layout
    n: int
    bits: int
    superblock: int
    block: int
    source: str  # GGUF type, e.g. "Q4_K"


class QuantLinear:
    """One linear layer [out_features, in_features] in the GGUF's quantized codes. Immutable after construction."""

    dtype = torch.float32  # what it takes and returns

    def __init__(self, parts: list[Part], k: int, module: ModuleType) -> None:
        assert parts and all(p.packed.dtype == torch.uint8 for p in parts)
        self.parts = tuple(parts)
        self.shape = torch.Size((sum(p.n for p in parts), k))
        self.device = torch.device("cpu")
        self._module = module
        self.nbytes = sum(p.packed.numel() for p in parts)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def formats(self) -> list[str]:
        return [p.source for p in self.parts]

    @property
    def kernels(self) -> ModuleType:
        """The build of kernels/quant_linear.cpp that runs it (its Q4LayerStack runs a model of such linears)."""
        return self._module

    @property
    def isa(self) -> str:
        """Which build of the kernels runs it (quant_kernels.py: the registry's q4 build, e.g. avx512 or avx2)."""
        return str(self._module.isa())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_fp32: bool = True) -> torch.Tensor:
        x = x.float().contiguous()
        out = torch.empty(x.shape[0], self.shape[0], dtype=torch.float32)
        col = 0
        for p in self.parts:
            self._module.quant_linear_into(x, p.packed, p.n, p.bits, p.superblock, p.block, out, col)
            col += p.n
        return out + bias if bias is not None else out

    def unpack(self) -> torch.Tensor:
        """The float32 [N, K] weight (each value the GGUF's)."""
        k = self.shape[1]
        return torch.cat([torch.from_numpy(unpack(p.packed.numpy(), p.n, k, p.bits, p.superblock, p.block).dequantize())
                          for p in self.parts])


def _llama_rows(n: int, heads: int) -> np.ndarray:
    """The row order transformers' GGUF loader restores for a llama q or k projection (reverse_permute_weights)."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)


def _merge(tensors: list[Affine]) -> list[Affine]:
    """Adjacent tensors of one format as one (their rows concatenated)."""
    out: list[Affine] = []
    for t in tensors:
        last = out[-1] if out else None
        if last is not None and (last.source, last.bits, last.superblock, last.block) == \
                (t.source, t.bits, t.superblock, t.block):
            out[-1] = Affine(*(np.concatenate([getattr(last, f), getattr(t, f)]) for f in ("q", "D", "M", "sc", "mn")),
                             t.bits, t.superblock, t.block, t.source)
        else:
            out.append(t)
    return out


def convert_quant(gguf_path: Path, out_file: Path, progress: bool = True) -> dict[str, object]:
    """Pack every linear of `gguf_path` into `out_file` (safetensors: uint8 parts; metadata: their formats).
    Raises UnsupportedQuantError for a linear in a format the kernels lack."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    layers = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    heads = int(reader.fields[f"{arch}.attention.head_count"].parts[-1][0])
    kv_heads = int(reader.fields[f"{arch}.attention.head_count_kv"].parts[-1][0])

    def affine(name: str) -> Affine:
        t = by_name[name]
        n, k = int(t.shape[1]), int(t.shape[0])
        a = to_affine(t.tensor_type.name, np.asarray(t.data), n, k)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = a.take_rows(_llama_rows(n, heads if "attn_q" in name else kv_heads))
        return a

    tensors: dict[str, np.ndarray] = {}
    layout: dict[str, list[dict[str, object]]] = {}

    def add(key: str, names: list[str]) -> None:
        parts = []
        for j, a in enumerate(_merge([affine(n) for n in names])):
            tensors[f"{key}.{j}"] = pack(a)
            parts.append({"tensor": f"{key}.{j}", "n": a.shape[0], "k": a.shape[1], "bits": a.bits,
                          "superblock": a.superblock, "block": a.block, "source": a.source})
        layout[key] = parts

    for i in range(layers):
        for key, names in LINEARS.items():
            add(f"layers.{i}.{key}", [f"blk.{i}.{n}.weight" for n in names])
        if progress and (i + 1) % 8 == 0:
            print(f"  q4: packed {i + 1}/{layers} layers", file=sys.stderr, flush=True)  # stdout: `--json`'s
    add("lm_head", ["output.weight" if "output.weight" in by_name else "token_embd.weight"])
    formats = sorted({p["source"] for parts in layout.values() for p in parts})  # type: ignore[misc]
    tmp = out_file.with_name(out_file.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"layout": json.dumps(layout), "formats": ",".join(formats)})
    tmp.chmod(0o644)  # the cache is read by every local process
    fsync_path(tmp)
    tmp.replace(out_file)
    return {"formats": formats, "bytes": sum(t.nbytes for t in tensors.values())}


def quant_linear(handle: object, parts: list[dict[str, object]], module: ModuleType) -> QuantLinear:
    loaded = [Part(handle.get_tensor(str(p["tensor"])).clone(), int(p["n"]), int(p["bits"]),  # type: ignore[attr-defined]
                   int(p["superblock"]), int(p["block"]), str(p["source"])) for p in parts]
    return QuantLinear(loaded, int(parts[0]["k"]), module)


def load_quant_linears(checkpoint_dir: Path, config: ModelConfig, module: ModuleType) -> tuple[list[dict[str, QuantLinear]], QuantLinear]:
    """Every layer's {qkv, o, gate_up, down} and the lm_head, from the cached quant file (prepare_quant makes it)."""
    from safetensors import safe_open

    with safe_open(str(checkpoint_dir / QUANT_FILE), framework="pt") as handle:
        layout = json.loads(handle.metadata()["layout"])
        layers = [{key: quant_linear(handle, layout[f"layers.{i}.{key}"], module) for key in LINEARS}
                  for i in range(config.num_layers)]
        lm_head = quant_linear(handle, layout["lm_head"], module)
    if lm_head.shape[0] != config.vocab_size:
        raise UnsupportedQuantError(f"{checkpoint_dir}: the quantized lm_head has {lm_head.shape[0]} rows, the config "
                                    f"{config.vocab_size}")
    return layers, lm_head
