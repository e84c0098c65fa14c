"""A ragged forward batch: each sequence brings its past length and one or more new tokens.

For one sequence with past_len = 5, block_size = 4, block_table = [7, 2, 9], three new tokens:

    position :  0  1  2  3 | 4  5  6  7 | 8
    block    :      7      |     2      |  9
    past     :  x  x  x  x   x                  (read from the pool through block_table)
    new      :                  n0 n1 n2        (written to slot_mapping, e.g. [2*4+1, 2*4+2, 2*4+3])

New tokens attend to all past positions and to each other through `attn_mask` ([n_new, n_new],
True = may attend); the default is causal. A token tree passes its ancestor mask and its own
positions (root depth d -> position past_len + d) and slots (one per node).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from model_runtime.attention import WidthGroup, plan_attention


@dataclass
class SeqInput:
    token_ids: list[int]
    past_len: int
    block_table: list[int]
    slot_mapping: list[int]  # flat slot per new token
    positions: list[int] | None = None  # default: past_len .. past_len + n - 1
    attn_mask: torch.Tensor | None = None  # [n, n] bool, default causal
    logits: str | int = "all"  # "all" | "last" | "none" | N (the last N new tokens)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert n > 0, "a sequence must bring at least one new token"
        assert self.past_len >= 0
        assert len(self.slot_mapping) == n, "one slot per new token"
        assert self.positions is None or len(self.positions) == n
        assert self.attn_mask is None or tuple(self.attn_mask.shape) == (n, n)
        assert self.logits in ("all", "last", "none") or (isinstance(self.logits, int) and 0 <= self.logits <= n)


@dataclass
class ForwardBatch:
    """Flattened tensors over all new tokens of all sequences (T tokens in total)."""

    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long
    seqs: list[SeqInput]
    offsets: list[int]  # start of each sequence's new tokens in the flat tensors
    attention: tuple[WidthGroup, ...]  # rows grouped by padded key width (model_runtime/attention.py)
    logits_rows: torch.Tensor  # [R] rows of the flat batch whose logits are returned
    logits_counts: list[int]  # per sequence number of rows in logits_rows

    def to(self, device: torch.device) -> ForwardBatch:
        """The same batch with its tensors on `device` (once per forward, not once per layer)."""
        return dataclasses.replace(
            self, token_ids=self.token_ids.to(device), positions=self.positions.to(device),
            slot_mapping=self.slot_mapping.to(device), attention=tuple(g.to(device) for g in self.attention),
            logits_rows=self.logits_rows.to(device))

    @classmethod
    def build(cls, seqs: list[SeqInput], block_size: int) -> ForwardBatch:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        attention: list[tuple[int, torch.Tensor, torch.Tensor | int]] = []
        rows: list[int] = []
        counts: list[int] = []
        for seq in seqs:
            n = len(seq.token_ids)
            offsets.append(len(tokens))
            needed_blocks = -(-seq.past_len // block_size)
            assert len(seq.block_table) >= needed_blocks, "block table does not cover the past"
            table = torch.tensor(seq.block_table[:needed_blocks], dtype=torch.long)
            past_slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:seq.past_len]
            kv_slots = torch.cat([past_slots, torch.tensor(seq.slot_mapping, dtype=torch.long)])
            if seq.attn_mask is None:  # causal: the plan from the row count alone
                attention.append((len(tokens), kv_slots, n))
            else:
                past_mask = torch.ones(n, seq.past_len, dtype=torch.bool)
                attention.append((len(tokens), kv_slots, torch.cat([past_mask, seq.attn_mask.to(torch.bool)], dim=1)))
            wanted = {"all": n, "last": 1, "none": 0}.get(seq.logits, seq.logits)  # type: ignore[call-overload]
            rows.extend(range(len(tokens) + n - wanted, len(tokens) + n))
            counts.append(wanted)
            tokens.extend(seq.token_ids)
            positions.extend(seq.positions if seq.positions is not None else range(seq.past_len, seq.past_len + n))
            slots.extend(seq.slot_mapping)
        return cls(
            token_ids=torch.tensor(tokens, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            seqs=seqs,
            offsets=offsets,
            attention=plan_attention(attention),
            logits_rows=torch.tensor(rows, dtype=torch.long),
            logits_counts=counts,
        )
