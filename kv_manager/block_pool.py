"""One namespace's blocks: state, reference counts, the free list and the prefix-cache index.

Free-list order (allocation takes the head):

    head -> [blocks without content ...][blocks with cached content, least recently freed first] <- tail

A freed block without reusable content goes to the head (it is reused first, so a rollback followed
by the same reservation gets the same block ids back); a freed full block whose content is indexed
goes to the tail and stays a prefix-cache hit until it reaches the head and is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kv_manager.schema import BlockState, NamespaceConfig

ROOT_HASH = 0  # parent hash of a sequence's first block


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Content hash of a full block: its tokens chained to the hash of every block before it."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    state: BlockState = BlockState.FREE
    committed_slots: int = 0  # leading slots holding verified KV (same for every holder)
    block_hash: int | None = None  # set once the block is full and committed
    token_ids: tuple[int, ...] = ()  # the full block's tokens, checked on every cache hit


class BlockPool:
    def __init__(self, config: NamespaceConfig) -> None:
        self.config = config
        self.name = config.name
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.blocks: list[Block] = [Block(block_id) for block_id in range(config.num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(config.num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.writers: set[str] = set()  # workers whose memory holds this namespace's content

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> Block:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0 and block.state is BlockState.FREE, block
        self._forget(block)
        block.ref_count = 1
        block.state = BlockState.RESERVED
        return block

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> Block | None:
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def take_shared(self, block: Block) -> None:
        """One more holder of a full committed block (a prefix hit or a dedupe)."""
        assert block.block_hash is not None, block
        if block.ref_count == 0:
            assert block.state is BlockState.FREE, block
            del self.free_blocks[block.block_id]
            block.state = BlockState.COMMITTED
            block.committed_slots = self.block_size
        assert block.state is BlockState.COMMITTED and block.committed_slots == self.block_size, block
        block.ref_count += 1

    def incref(self, block: Block) -> None:
        assert block.ref_count > 0 and block.state is not BlockState.FREE, block
        block.ref_count += 1

    def decref(self, block: Block, *, keep_content: bool = True) -> bool:
        """Drop one holder; returns True when the block became free."""
        assert block.ref_count > 0, block
        block.ref_count -= 1
        if block.ref_count:
            return False
        block.state = BlockState.FREE
        block.committed_slots = 0
        cached = keep_content and self._is_indexed(block)
        if not cached:
            self._forget(block)
        self.free_blocks[block.block_id] = None
        if not cached:
            self.free_blocks.move_to_end(block.block_id, last=False)
        return True

    def register_full(self, block: Block, block_hash: int, token_ids: tuple[int, ...]) -> None:
        assert block.ref_count == 1 and block.block_hash is None, block
        assert len(token_ids) == self.block_size
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.hash_to_block.setdefault(block_hash, block.block_id)  # a hash collision stays unindexed

    def forget_free_content(self) -> None:
        """The memory behind this namespace was lost: free blocks are no longer prefix-cache hits."""
        for block_hash, block_id in list(self.hash_to_block.items()):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.hash_to_block[block_hash]
                block.block_hash = None
                block.token_ids = ()
                self.free_blocks.move_to_end(block_id, last=False)

    def _is_indexed(self, block: Block) -> bool:
        return block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block.block_id

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == block.block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
