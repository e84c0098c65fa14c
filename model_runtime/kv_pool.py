"""Paged KV pools: per layer one K and one V tensor of shape [num_blocks, block_size, kv_heads_per_rank, head_dim].

Owner: the worker process that runs the model (one pool per model per rank). Block ids and slot
indices are granted by the KV-block manager; the pool only stores what it is told to.

    slot = block_id * block_size + offset      (flat view: [num_blocks * block_size, kv_heads, head_dim])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runtime.config import ModelConfig


@dataclass
class KVPool:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, tp_size: int = 1,
        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    ) -> KVPool:
        assert num_blocks > 0 and block_size > 0
        kv_heads = config.num_kv_heads // tp_size
        shape = (num_blocks, block_size, kv_heads, config.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        return cls(k=k, v=v, block_size=block_size)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy every layer's K/V of block src into block dst."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for layer_k, layer_v in zip(self.k, self.v, strict=True):
            layer_k[dst] = layer_k[src]
            layer_v[dst] = layer_v[src]

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Copy every layer's K/V at slot src into slot dst, for each (src, dst) in order: a token tree's
        accepted path compacted to the front of its reservation. A path's moves never read a slot an earlier
        move wrote (dst < src, both increasing), so one gather-then-scatter gives the in-order result."""
        if not moves:
            return
        src = torch.tensor([s for s, _ in moves])
        dst = torch.tensor([d for _, d in moves])
        for layer_k, layer_v in zip(self.k, self.v, strict=True):
            flat_k, flat_v = layer_k.view(-1, *layer_k.shape[2:]), layer_v.view(-1, *layer_v.shape[2:])
            flat_k[dst] = flat_k[src]
            flat_v[dst] = flat_v[src]
