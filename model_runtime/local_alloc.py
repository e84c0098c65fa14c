"""A minimal local block allocator for running the model without the KV-block manager
(runtime tests and `specserve bench runtime`). The engine uses kv_manager's ledger instead.

Owner: the caller that created it; not thread safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_runtime.batch import SeqInput


@dataclass
class LocalSequence:
    block_table: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is in the pool


class LocalAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_blocks))

    def extend(self, seq: LocalSequence, token_ids: list[int], logits: str = "all") -> SeqInput:
        """Grow `seq` by len(token_ids) slots and return the SeqInput that writes them."""
        new_len = seq.length + len(token_ids)
        while len(seq.block_table) * self.block_size < new_len:
            assert self.free_blocks, "local allocator out of blocks"
            seq.block_table.append(self.free_blocks.pop(0))
        slots = [seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
                 for pos in range(seq.length, new_len)]
        item = SeqInput(token_ids=list(token_ids), past_len=seq.length, block_table=list(seq.block_table),
                        slot_mapping=slots, logits=logits)
        seq.length = new_len
        return item

    def free(self, seq: LocalSequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table.clear()
        seq.length = 0
