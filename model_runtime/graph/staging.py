"""A step's inputs as one flat int64 buffer per bucket: built on the host, copied to the device in one transfer.

For a bucket of B sequences, R rows, NB blocks (and a draft chain of S steps), the buffer holds, in order:

    token_ids   [B, R]       new tokens (padding rows: 0)
    positions   [B, R]       their positions (a tree's: root + depth)
    slots       [B, R]       the pool slot each new row's K/V goes to (padding rows: scratch slots)
    tables      [B, NB]      block tables (past the sequence's own blocks: the first scratch block)
    past_lens   [B]          keys before the step (a row sees positions [0, past) of its table, then the new
                             rows its mask allows)
    row_mask    [B, R, R]    1 where a new row sees a new row: causal, a tree's ancestors; a padding row only
                             itself (so every softmax has a key; its output is dropped)
    first_row   [B]          the row whose argmax answers the first draft (n - 1 - drafts)
    drafts      [B]          drafted rows after it (0: a decode, or a draft chain's catch-up)
    chain_slots [B, S - 1]   a draft chain's slots for its steps after the first (the table's next positions)

Scratch: the pool's last blocks (CapturedRunner allocates them past the ledger's) take every padding row's K/V,
so a padded step never writes a block the ledger granted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runtime.batch import SeqInput
from model_runtime.graph.buckets import Bucket


@dataclass(frozen=True)
class StepInputs:
    """Views of one bucket's buffer (host or device), as static_forward and greedy.py read them."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    past_lens: torch.Tensor
    row_mask: torch.Tensor
    first_row: torch.Tensor
    drafts: torch.Tensor
    chain_slots: torch.Tensor


@dataclass(frozen=True)
class Scratch:
    """Slots [start, start + count) of the pool, written only by padding rows."""

    start: int
    count: int

    def slots(self, first: int, n: int) -> torch.Tensor:
        return self.start + (torch.arange(first, first + n) % self.count)


def layout(bucket: Bucket, chain: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    b, r = bucket.batch, bucket.rows
    return [("token_ids", (b, r)), ("positions", (b, r)), ("slots", (b, r)), ("tables", (b, bucket.blocks)),
            ("past_lens", (b,)), ("row_mask", (b, r, r)), ("first_row", (b,)), ("drafts", (b,)),
            ("chain_slots", (b, chain - 1))]


def buffer_size(bucket: Bucket, chain: int = 1) -> int:
    return sum(torch.Size(shape).numel() for _, shape in layout(bucket, chain))


def views(flat: torch.Tensor, bucket: Bucket, chain: int = 1) -> StepInputs:
    """The fields of a bucket's flat buffer, as views (writing the buffer changes them)."""
    fields, at = {}, 0
    for name, shape in layout(bucket, chain):
        size = torch.Size(shape).numel()
        fields[name] = flat[at:at + size].view(shape)
        at += size
    assert at == flat.numel(), (at, flat.numel())
    return StepInputs(**fields)


def needed_blocks(seq: SeqInput, block_size: int, chain: int = 1) -> int:
    """Blocks of the table a step reads through it: the past, and for a chain of S steps the catch-up's rows and
    the first S - 2 drafts (the chain's later steps read them as past)."""
    extra = len(seq.token_ids) + chain - 2 if chain > 1 else 0
    return -(-(seq.past_len + extra) // block_size)


def stage(seqs: list[SeqInput], drafts: list[int], bucket: Bucket, block_size: int, scratch: Scratch,
          chain: int = 1, chain_slots: list[list[int]] | None = None) -> torch.Tensor:
    """The bucket's buffer for `seqs` (each within the bucket), `drafts[i]` of seq i's rows being drafts, on the
    host. A chain of S > 1 steps needs each sequence's S - 1 later slots (`chain_slots`), and its new rows in the
    table's own next slots (the later steps read them through the table)."""
    assert len(seqs) == len(drafts) <= bucket.batch
    flat = torch.zeros(buffer_size(bucket, chain), dtype=torch.long)
    x = views(flat, bucket, chain)
    r_max = bucket.rows
    x.slots.copy_(scratch.slots(0, bucket.batch * r_max).view(bucket.batch, r_max))
    x.chain_slots.copy_(scratch.slots(0, bucket.batch * (chain - 1)).view(bucket.batch, chain - 1))
    x.tables.fill_(scratch.start // block_size)
    x.row_mask.copy_(torch.eye(r_max, dtype=torch.long).expand(bucket.batch, r_max, r_max))
    for b, (seq, drafted) in enumerate(zip(seqs, drafts, strict=True)):
        n = len(seq.token_ids)
        assert n <= r_max and 0 <= drafted < n, (n, r_max, drafted)
        blocks = needed_blocks(seq, block_size, chain)
        assert blocks <= bucket.blocks and len(seq.block_table) >= blocks, (blocks, bucket, len(seq.block_table))
        x.token_ids[b, :n] = torch.tensor(seq.token_ids)
        x.positions[b, :n] = torch.tensor(seq.positions if seq.positions is not None
                                          else range(seq.past_len, seq.past_len + n))
        x.slots[b, :n] = torch.tensor(seq.slot_mapping)
        x.tables[b, :blocks] = torch.tensor(seq.block_table[:blocks])
        x.past_lens[b] = seq.past_len
        mask = seq.attn_mask if seq.attn_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
        x.row_mask[b, :n, :n] = mask.long()
        x.first_row[b] = n - 1 - drafted
        x.drafts[b] = drafted
        if chain > 1:
            assert chain_slots is not None and len(chain_slots[b]) == chain - 1
            table = seq.block_table
            assert len(table) * block_size >= seq.past_len + n + chain - 1, "the table holds the chain's slots"
            want = [table[p // block_size] * block_size + p % block_size
                    for p in range(seq.past_len, seq.past_len + n + chain - 1)]
            assert want == list(seq.slot_mapping) + list(chain_slots[b]), "a chain's slots follow its table"
            x.chain_slots[b] = torch.tensor(chain_slots[b])
    return flat
