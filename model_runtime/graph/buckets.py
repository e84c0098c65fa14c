"""The static shapes a captured step takes: a step's batch, rows and context are padded up to the next bucket.

    batch   sequences in the step (padding sequences: all rows padding, writing the scratch block)
    rows    new rows per sequence (a decode 1, a chain's verify k+1, a tree's nodes + catch-up)
    blocks  block-table width: the keys a row may read from the pool before its own step's rows

A step that fits no bucket (a prefill, a batch past the largest) runs the eager forward instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    rows: int
    blocks: int

    def __post_init__(self) -> None:
        assert self.batch > 0 and self.rows > 0 and self.blocks > 0, self


@dataclass(frozen=True)
class Buckets:
    """The sizes a model's steps are captured at (each ascending); every combination is one bucket."""

    batches: tuple[int, ...] = (1, 2, 4, 8)
    rows: tuple[int, ...] = (1, 2, 3, 5, 9, 17)
    blocks: tuple[int, ...] = (16, 64, 256)  # x block_size tokens of context before the step

    def __post_init__(self) -> None:
        for sizes in (self.batches, self.rows, self.blocks):
            assert sizes and list(sizes) == sorted(set(sizes)) and sizes[0] > 0, sizes

    @classmethod
    def up_to(cls, max_batch: int, max_rows: int, max_context: int, block_size: int) -> Buckets:
        """Powers of two of sequences up to max_batch, the rows of decode and of verifies of 1, 2, 4, 8, 16
        drafts up to max_rows, contexts of 256 tokens x 4^i up to max_context (each list ends at its maximum)."""
        def ladder(start: int, factor: int, top: int) -> tuple[int, ...]:
            sizes, s = [], start
            while s < top:
                sizes.append(s)
                s *= factor
            return tuple(sorted({*sizes, top}))

        rows = tuple(sorted({r for r in (1, 2, 3, 5, 9, 17) if r <= max_rows} | {max_rows}))
        top_blocks = -(-max_context // block_size)
        return cls(ladder(1, 2, max_batch), rows, ladder(min(-(-256 // block_size), top_blocks), 4, top_blocks))

    def all(self) -> list[Bucket]:
        return [Bucket(b, r, n) for b, r, n in product(self.batches, self.rows, self.blocks)]



def smallest_holding(buckets: list[Bucket], batch: int, rows: int, blocks: int) -> Bucket | None:
    """The smallest of `buckets` holding a step of `batch` sequences of at most `rows` new rows each, reading at
    most `blocks` blocks of past through their tables; None where none does (the eager forward)."""
    holding = [b for b in buckets if b.batch >= batch and b.rows >= rows and b.blocks >= max(blocks, 1)]
    return min(holding, default=None)
