"""The forward of one step over a bucket's staged inputs: static shapes, no host read, capturable.

The same model as model.py's forward (its rms_norm, silu_mul, rope; the pool's layout), for the torch path
(float32 or bfloat16 weights as plain tensors, one rank). What differs is how a row finds its keys:

    past keys  pool[tables[b]] gathered on the device: [B, NB * block_size] positions, those >= past_lens[b]
               masked (they may hold anything: other requests' keys, scratch)
    new keys   the step's own rows' K/V, concatenated after them (also written to the pool at `slots`), seen as
               row_mask says
    scores     [B, kv_heads, R * group, NB * block_size + R] in float32, masked, softmax, @ values

so every shape follows the bucket, not the step, and nothing in the forward reads a tensor's value on the host
(no .item(), .tolist(), nonzero or boolean indexing). A row's result is the eager forward's within rounding
(another key width and row count in its products: tests/model_runtime/graph/test_static_forward.py states the
bound), not bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_runtime.config import ModelConfig
from model_runtime.graph.staging import StepInputs
from model_runtime.kv_pool import KVPool
from model_runtime.model import CausalLM, apply_rope, rms_norm, rope_cos_sin, silu_mul
from model_runtime.weights import LayerWeights, ModelWeights


class NotCapturableError(ValueError):
    """A model whose forward this path cannot run: packed, quantized or tensor-parallel weights."""


@dataclass(frozen=True)
class StaticModel:
    """A model's plain weights and its pool, as the captured forward reads them (the tensors are the model's and
    the pool's own: a captured program writes the pool the ledger's slots name)."""

    config: ModelConfig
    weights: ModelWeights
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    block_size: int
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: CausalLM, kv: KVPool) -> StaticModel:
        if model.tp_size != 1:
            raise NotCapturableError(f"tensor parallel size {model.tp_size}: the captured step runs one rank")
        w = model.weights
        plain = [w.embed, w.final_norm, w.lm_head, *(t for lw in w.layers for t in (lw.qkv, lw.o, lw.gate_up, lw.down))]
        if not all(isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.bfloat16) for t in plain):
            raise NotCapturableError(f"the captured step runs plain float32/bfloat16 weights (this model's linears "
                                     f"run {model.linear_kernel!r})")
        return cls(model.config, w, tuple(kv.k), tuple(kv.v), kv.block_size, model.num_heads, model.num_kv_heads,
                   model.dtype)


def visibility(x: StepInputs, past_width: int) -> torch.Tensor:
    """[B, R, past_width + R] bool: row r of sequence b sees past position j < past_lens[b] and new row c where
    row_mask[b, r, c]."""
    batch, rows = x.token_ids.shape
    past = torch.arange(past_width, device=x.past_lens.device)[None, None, :] < x.past_lens[:, None, None]
    return torch.cat([past.expand(batch, rows, past_width), x.row_mask != 0], dim=2)


def past_key_slots(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, NB * block_size]: the pool slot of each table position."""
    offsets = torch.arange(block_size, device=tables.device)
    return (tables[:, :, None] * block_size + offsets).flatten(1)


def attend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
           key_slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [B, R, heads, d], k_new/v_new [B, R, kv_heads, d], the pool's flat K/V [slots, kv_heads, d], key_slots
    [B, P], visible [B, R, P + R] -> [B, R, heads, d] in q's dtype (float32 products, as attention.py's)."""
    batch, rows, heads, d = q.shape
    kv_heads = k_new.shape[2]
    group = heads // kv_heads
    past = key_slots.shape[1]
    keys = torch.cat([k_flat.index_select(0, key_slots.flatten()).view(batch, past, kv_heads, d), k_new], dim=1)
    values = torch.cat([v_flat.index_select(0, key_slots.flatten()).view(batch, past, kv_heads, d), v_new], dim=1)
    width = past + rows
    qg = (q.float() * d ** -0.5).view(batch, rows, kv_heads, group, d).permute(0, 2, 1, 3, 4)
    qg = qg.reshape(batch, kv_heads, rows * group, d)
    kg = keys.permute(0, 2, 3, 1).float()  # [B, kv, d, width]
    vg = values.permute(0, 2, 1, 3).float()  # [B, kv, width, d]
    scores = torch.matmul(qg, kg).view(batch, kv_heads, rows, group, width)
    scores = scores.masked_fill(~visible[:, None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, rows * group, width)
    out = torch.matmul(probs, vg).view(batch, kv_heads, rows, group, d).permute(0, 2, 1, 3, 4)
    return out.reshape(batch, rows, heads, d).to(q.dtype)


def _layer(m: StaticModel, index: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           x: StepInputs, key_slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    cfg, d, hq, hkv = m.config, m.config.head_dim, m.num_heads, m.num_kv_heads
    batch, rows = x.token_ids.shape
    tokens = batch * rows
    a = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
    qk, v = F.linear(a, lw.qkv, lw.qkv_bias).split([(hq + hkv) * d, hkv * d], dim=-1)  # type: ignore[arg-type]
    q, k = apply_rope(qk.reshape(tokens, hq + hkv, d), cos, sin).split([hq, hkv], dim=1)
    v = v.reshape(tokens, hkv, d)
    k_flat, v_flat = m.k[index].view(-1, hkv, d), m.v[index].view(-1, hkv, d)
    slots = x.slots.flatten()
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v)
    out = attend(q.reshape(batch, rows, hq, d), k.reshape(batch, rows, hkv, d), v.reshape(batch, rows, hkv, d),
                 k_flat, v_flat, key_slots, visible)
    h = h + F.linear(out.reshape(tokens, hq * d), lw.o)  # type: ignore[arg-type]
    a = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
    return h + F.linear(silu_mul(F.linear(a, lw.gate_up)), lw.down)  # type: ignore[arg-type]


def static_forward(m: StaticModel, x: StepInputs) -> torch.Tensor:
    """Every row's logits [B, R, vocab] float32; the new rows' K/V written to the pool at x.slots."""
    cfg = m.config
    batch, rows = x.token_ids.shape
    cos, sin = rope_cos_sin(x.positions.flatten(), cfg.head_dim, cfg.rope_theta, m.dtype)
    h = F.embedding(x.token_ids.flatten(), m.weights.embed)
    key_slots = past_key_slots(x.tables, m.block_size)
    visible = visibility(x, key_slots.shape[1])
    for index, lw in enumerate(m.weights.layers):
        h = _layer(m, index, lw, h, cos, sin, x, key_slots, visible)
    h = rms_norm(h, m.weights.final_norm, cfg.rms_norm_eps)
    return F.linear(h, m.weights.lm_head).float().view(batch, rows, -1)  # type: ignore[arg-type]
