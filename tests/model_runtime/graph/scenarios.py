"""Steps the graph tests run: a prefilled batch, then a decode, a chain's verify and a tree, mixed in one step;
the same step through the eager forward on a copy of the pool."""

from __future__ import annotations

import dataclasses

import torch

from model_runtime.batch import SeqInput
from model_runtime.graph.runner import CapturedRunner
from model_runtime.kv_pool import KVPool
from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM

BLOCK = 4
NUM_BLOCKS = 48
PROMPTS = ([1, 17, 33, 90, 4, 250, 11, 3, 42, 8, 199], [5, 77, 123, 9, 8, 7, 6], [60, 61, 62, 63, 64])
TREE_MASK = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


def pool_copy(kv: KVPool) -> KVPool:
    return KVPool([t.clone() for t in kv.k], [t.clone() for t in kv.v], kv.block_size)


def prefilled(runner: CapturedRunner) -> tuple[LocalAllocator, list[LocalSequence]]:
    """Each prompt prefilled (more rows than any bucket: the eager forward)."""
    alloc = LocalAllocator(NUM_BLOCKS, BLOCK)
    seqs = [LocalSequence() for _ in PROMPTS]
    runner.forward_seqs([alloc.extend(seq, prompt, "last") for seq, prompt in zip(seqs, PROMPTS, strict=True)])
    return alloc, seqs


def mixed_step(alloc: LocalAllocator, seqs: list[LocalSequence]) -> list[SeqInput]:
    """A decode, a verify of a pending token and three drafts, a tree of four nodes (root, two children, a
    grandchild: positions root + depth, ancestor mask)."""
    decode = alloc.extend(seqs[0], [44])
    verify = alloc.extend(seqs[1], [12, 13, 14, 15])
    tree = alloc.extend(seqs[2], [70, 71, 72, 73])
    past = tree.past_len
    tree = dataclasses.replace(tree, positions=[past, past + 1, past + 1, past + 2], attn_mask=TREE_MASK)
    return [decode, verify, tree]


def eager_on_copy(model: CausalLM, kv: KVPool, step: list[SeqInput]) -> list[torch.Tensor]:
    """The eager forward's logits for `step` on a copy of the pool (the pool itself untouched)."""
    return model.forward_seqs(step, pool_copy(kv))


def free_all(alloc: LocalAllocator, seqs: list[LocalSequence]) -> None:
    """Every block back: none leaked (the runner's scratch blocks lie past the allocator's)."""
    for seq in seqs:
        alloc.free(seq)
    assert sorted(alloc.free_blocks) == list(range(NUM_BLOCKS))

