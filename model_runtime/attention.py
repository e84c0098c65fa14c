"""Attention over the paged KV pool whose every row is computed the same way however many rows share the call.

A row's result must not depend on how many rows a forward holds: greedy speculative decoding scores k+1
rows in one call where plain decoding scores one, and its output equals plain decoding only if each row's
logits are bitwise the same. `F.scaled_dot_product_attention` is not (measured, torch 2.13 on this
project's CPU, bf16 and fp32: 7 of 9 verify rows differ from the same token decoded alone), and neither is a
plain matmul attention whose key length follows the call (the kernels block the reduction by the matrix
sizes). So the sizes are fixed per row, not per call:

    row r sees key positions [0, end_r)                  end_r = past + r + 1 for a causal chain
    its keys are padded to width_r = ceil(end_r / TILE) * TILE positions (masked, from a real slot)
    rows of one width, over all sequences of the forward, form a group:
        scores [seqs, kv_heads, rows*group_heads, width] = q @ K^T   (each sequence its own keys)
        softmax over width, out = probs @ V                            (fp32 throughout)

A row's products then have the same reduction length (head_dim, width) and layout whether it is decoded
alone or verified among others; only the number of rows (M) and of sequences (the batch) change, which the
kernels do not fold into a row's sums (tests/model_runtime/test_attention.py checks rows bitwise, both dtypes).
Sequences with fewer rows in a group are padded with copies of their first row (results dropped).
It is also faster than SDPA here: Qwen-1.5B heads, 500 keys, one row: ~0.35 ms against 0.76 ms fp32 /
1.3 ms bf16 (SDPA expands grouped-query heads); and one group serves every decoding sequence of a batch.

Masked positions point at a real slot of the sequence (finite values) and get probability exactly 0.

Where our CPU kernels run (model_runtime/kernel_registry.py), kernels/portable.cpp computes the same contract for
rows of every width: each row's scores, softmax and sum over its own visible keys in slot order, in float32, by the
same instructions whatever else is in the call (masked keys are skipped, not padded).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from types import ModuleType

import torch

TILE = 64  # keys are padded to a multiple of this per row


@dataclass(frozen=True)
class WidthGroup:
    """Every row of the forward whose keys pad to `width`, as [seqs, rows] (padded per sequence)."""

    width: int
    slots: torch.Tensor  # [seqs, width] long: each sequence's key slots, padded with its first slot
    rows: torch.Tensor  # [seqs, rows] long: rows of the flat batch (padding repeats a real row)
    hidden: torch.Tensor  # [seqs, rows, width] bool: the keys a row may not see (masked out)
    real: torch.Tensor  # [seqs * rows] bool: which entries are real rows (the rest is padding)
    real_rows: torch.Tensor  # rows.flatten()[real]: where the real entries' outputs go
    all_real: bool = False  # no padding entries (every sequence has as many rows in this group)
    whole: bool = False  # the group is every row of the forward, 0..T-1 in order: its output is the forward's

    def to(self, device: torch.device) -> WidthGroup:
        return WidthGroup(self.width, self.slots.to(device), self.rows.to(device), self.hidden.to(device),
                          self.real.to(device), self.real_rows.to(device), self.all_real, self.whole)


def _seq_rows_by_width(offset: int, kv_slots: torch.Tensor, mask: torch.Tensor
                       ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One sequence: [(width, its padded key slots, its flat rows, their visibility [rows, width])]."""
    n, length = mask.shape
    assert kv_slots.shape[0] == length and n > 0
    ends = torch.where(mask, torch.arange(1, length + 1), 0).amax(dim=1)
    assert bool((ends > 0).all()), "every row must see at least one key"
    widths = (ends + TILE - 1) // TILE * TILE
    top = int(widths.max())
    slots = torch.cat([kv_slots, kv_slots[:1].expand(top - length)]) if top > length else kv_slots
    padded = torch.cat([mask, mask.new_zeros(n, top - length)], dim=1) if top > length else mask
    out = []
    for width in sorted(set(widths.tolist())):
        rows = (widths == width).nonzero().flatten()
        out.append((int(width), slots[:width], rows + offset, padded[rows, :width]))
    return out


def _causal_rows_by_width(offset: int, kv_slots: torch.Tensor, n: int
                          ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`_seq_rows_by_width` of a causal chain's mask (n new rows after L - n past keys, row r sees the first
    L - n + r + 1), from its row ends in Python ints: the same tensors, without building and scanning the mask
    (most of a decode step's batch building: docs/forward.md, "The greedy token: argmax rows")."""
    length = kv_slots.shape[0]
    assert 0 < n <= length
    ends = range(length - n + 1, length + 1)
    widths = [(end + TILE - 1) // TILE * TILE for end in ends]
    top = widths[-1]
    slots = torch.cat([kv_slots, kv_slots[:1].expand(top - length)]) if top > length else kv_slots
    keys = torch.arange(top)
    out, r0 = [], 0
    while r0 < n:  # widths grow with the row: each width's rows are one run
        r1 = r0 + 1
        while r1 < n and widths[r1] == widths[r0]:
            r1 += 1
        width = widths[r0]
        row_ends = torch.arange(ends[r0], ends[r1 - 1] + 1)
        out.append((width, slots[:width], torch.arange(offset + r0, offset + r1), keys[:width] < row_ends[:, None]))
        r0 = r1
    return out


Member = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # one sequence's rows of a width: slots, rows, visibility


def plan_attention(seqs: list[tuple[int, torch.Tensor, torch.Tensor | int]]) -> tuple[WidthGroup, ...]:
    """seqs: per sequence (offset of its first new token in the flat batch, kv_slots [L] of its past then new
    tokens, mask [n, L] bool, or n for a causal chain of n new rows: the same plan as its mask's). Built once
    per forward; every layer uses it."""
    by_width: dict[int, list[Member]] = defaultdict(list)
    total = sum(mask if isinstance(mask, int) else mask.shape[0] for _, _, mask in seqs)  # the forward's rows
    for offset, kv_slots, mask in seqs:
        plan = _causal_rows_by_width(offset, kv_slots, mask) if isinstance(mask, int) else \
            _seq_rows_by_width(offset, kv_slots, mask)
        for width, slots, rows, visible in plan:
            by_width[width].append((slots, rows, visible))
    return tuple(_lone_group(width, members[0], total) if len(members) == 1 else _group(width, members, total)
                 for width, members in sorted(by_width.items()))


def _group(width: int, members: list[Member], total: int) -> WidthGroup:
    """The rows of `width` over several sequences, each padded to the most rows among them."""
    most = max(rows.shape[0] for _, rows, _ in members)
    rows_t = torch.stack([torch.cat([r, r[:1].expand(most - r.shape[0])]) for _, r, _ in members])
    visible = torch.stack([torch.cat([v, v[:1].expand(most - v.shape[0], -1)]) for _, _, v in members])
    real = torch.stack([torch.arange(most) < r.shape[0] for _, r, _ in members]).flatten()
    flat = rows_t.flatten()
    all_real = bool(real.all())
    whole = all_real and flat.numel() == total and bool((flat == torch.arange(total)).all())
    return WidthGroup(width, torch.stack([s for s, _, _ in members]), rows_t, ~visible, real, flat[real], all_real,
                      whole)


def _lone_group(width: int, member: Member, total: int) -> WidthGroup:
    """`_group` of one sequence's rows (a decode step, a chain's verify): nothing to pad, the same tensors."""
    slots, rows, visible = member
    # rows are distinct, ascending and below `total`: all of them exactly when there are `total` from 0
    whole = rows.shape[0] == total and int(rows[0]) == 0
    return WidthGroup(width, slots[None], rows[None], ~visible[None], torch.ones(rows.shape[0], dtype=torch.bool),
                      rows, True, whole)


def kernel_head_dim(head_dim: int) -> bool:
    """Whether the kernels' attention (kernels/portable.cpp) handles heads of this size."""
    return head_dim % 16 == 0 and head_dim <= 256


def _row_kernel(q: torch.Tensor, rows: ModuleType | None | str) -> ModuleType | None:
    """The kernels' attention for q's head dim where the model has row kernels (`rows`; "auto": the ones
    model_runtime/cpu_kernels.py resolves for q's dtype now); None: the products below."""
    if rows == "auto":
        from model_runtime.cpu_kernels import for_dtype

        rows = for_dtype(q.dtype, q.device).rows
    return rows if kernel_head_dim(q.shape[-1]) else None  # type: ignore[return-value]


def paged_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                    groups: tuple[WidthGroup, ...], rows: ModuleType | None | str = "auto") -> torch.Tensor:
    """q: [T, heads, d] (every new token of the forward, roped); k_flat/v_flat: [slots, kv_heads, d] (the pool,
    the new tokens already written). Returns [T, heads, d] in q's dtype. `rows`: the model's row kernels
    (CausalLM.kernels.rows), None for the float32 products, "auto" for what this process would pick."""
    tokens, heads, d = q.shape
    kernel = _row_kernel(q, rows)
    kv_heads = k_flat.shape[1]
    group = heads // kv_heads
    out = torch.empty(tokens, heads, d, dtype=q.dtype, device=q.device)
    scale = d ** -0.5
    for g in groups:
        if kernel is not None:
            kernel.paged_attention_group(q, k_flat, v_flat, g.slots, g.rows, g.hidden, g.real, out, scale)
            continue
        seqs, rows = g.rows.shape
        slots = g.slots.flatten()
        keys = k_flat.index_select(0, slots).view(seqs, g.width, kv_heads, d)
        values = v_flat.index_select(0, slots).view(seqs, g.width, kv_heads, d)
        mine = q if g.whole else q.index_select(0, g.rows.flatten())
        qg = (mine.float() * scale).view(seqs, rows, kv_heads, group, d)
        qg = qg.permute(0, 2, 1, 3, 4).reshape(seqs, kv_heads, rows * group, d)
        # fp32 and head-major in one copy each; K^T is a transposed view (the products read it as it lies)
        kg = keys.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format).transpose(2, 3)
        vg = values.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)  # [seqs, kv, width, d]
        scores = torch.matmul(qg, kg).view(seqs, kv_heads, rows, group, g.width)
        scores.masked_fill_(g.hidden[:, None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(seqs, kv_heads, rows * group, g.width)
        og = torch.matmul(probs, vg).view(seqs, kv_heads, rows, group, d).permute(0, 2, 1, 3, 4)
        og = og.reshape(seqs * rows, heads, d)
        if g.whole:
            return og.to(q.dtype)  # no scatter
        out.index_copy_(0, g.real_rows, (og if g.all_real else og[g.real]).to(q.dtype))
    return out
