"""Weights packed once for the AMX kernels (kernels/amx_linear.cpp: the amx path of model_runtime/kernel_registry.py), and the model's weights swapped for
them at load: bfloat16 (`PackedBF16`, the target) or int8 per output channel (`PackedInt8`, a draft run with
`--draft-dtype int8`).

A packed weight holds the same values as its [N, K] tensor, zero-padded to multiples of 32 and permuted into
AMX's B-operand tiles: packed[nb, kb, i, 2 * j + p] = W[16 * nb + j, 32 * kb + 2 * i + p]. It replaces the
tensor (the model keeps one copy); `unpack()` rebuilds the [N, K] tensor for the few callers that need it
(bench runtime's transformers model). The embedding stays a tensor: with tied embeddings the lm_head is packed
as a second copy (Qwen-1.5B: 467 MB).
"""

from __future__ import annotations

import torch


def _pad_to(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class _PackedLinear:
    """What both packings share: the [N, K] shape, the kernel module (resolved once, off the hot path)."""

    dtype: torch.dtype

    def __init__(self, weight: torch.Tensor) -> None:
        from model_runtime.cpu_kernels import packed_module

        assert weight.dim() == 2 and weight.device.type == "cpu"
        module = packed_module()
        assert module is not None, f"a {type(self).__name__} exists only where a kernel that packs weights runs"
        self._module = module
        self.shape = torch.Size(weight.shape)
        self.device = weight.device

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


class PackedBF16(_PackedLinear):
    """One linear layer's weight [out_features, in_features] in AMX tiles. Immutable after construction."""

    dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor) -> None:
        assert weight.dtype == torch.bfloat16
        super().__init__(weight)
        n, k = weight.shape
        np_, kp = _pad_to(n, 32), _pad_to(k, 32)
        padded = weight if (np_, kp) == (n, k) else torch.zeros(np_, kp, dtype=weight.dtype)
        if padded is not weight:
            padded[:n, :k] = weight
        self.packed = padded.view(np_ // 16, 16, kp // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()

    def unpack(self) -> torch.Tensor:
        nb, kb = self.packed.shape[:2]
        full = self.packed.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)
        return full[: self.shape[0], : self.shape[1]].contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_fp32: bool = False) -> torch.Tensor:
        return self._module.amx_linear(x, self.packed, self.shape[0], bias, out_fp32)


class PackedInt8(_PackedLinear):
    """One linear layer's weight quantized to int8 per output channel (symmetric, scale = max|w| / 127) and packed
    into AMX's int8 tiles: packed[nb, kb, i, 4 * j + p] = Wq[16 * nb + j, 64 * kb + 4 * i + p]. Activations are
    quantized per row in the kernel. Outputs are bfloat16. Immutable after construction."""

    dtype = torch.int8

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        n, k = weight.shape
        np_, kp = _pad_to(n, 32), _pad_to(k, 64)
        padded = torch.zeros(np_, kp, dtype=torch.float32)
        padded[:n, :k] = weight.float()
        self.scale = (padded.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).contiguous()
        quantized = torch.round(padded / self.scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.packed = quantized.view(np_ // 16, 16, kp // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()

    def unpack(self) -> torch.Tensor:
        """The dequantized [N, K] weight (bfloat16)."""
        nb, kb = self.packed.shape[:2]
        full = self.packed.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 64).float() * self.scale[:, None]
        return full[: self.shape[0], : self.shape[1]].bfloat16().contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_fp32: bool = False) -> torch.Tensor:
        out = self._module.amx_linear_i8(x.bfloat16(), self.packed, self.scale, self.shape[0], bias)
        return out.float() if out_fp32 else out


Packed = PackedBF16 | PackedInt8


def as_tensor(weight: torch.Tensor | Packed) -> torch.Tensor:
    """The [N, K] tensor (a copy for a packed weight, dequantized for int8)."""
    return weight if isinstance(weight, torch.Tensor) else weight.unpack()
