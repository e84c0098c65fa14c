"""Staging: a step's inputs in one flat buffer, padding rows on scratch slots, exact values."""

from __future__ import annotations

import pytest
import torch

from model_runtime.batch import SeqInput
from model_runtime.graph.buckets import Bucket
from model_runtime.graph.staging import Scratch, buffer_size, needed_blocks, stage, views

BLOCK = 4
SCRATCH = Scratch(start=40, count=8)  # blocks 10 and 11 of a pool of 12


def test_a_decode_and_a_verify_staged_with_padding() -> None:
    decode = SeqInput([7], past_len=5, block_table=[3, 1], slot_mapping=[1 * 4 + 1])
    verify = SeqInput([8, 9, 10], past_len=2, block_table=[2], slot_mapping=[10, 11, 12])  # slot 12: block 3
    bucket = Bucket(batch=3, rows=3, blocks=2)
    flat = stage([decode, verify], [0, 2], bucket, BLOCK, SCRATCH)
    assert flat.shape == (buffer_size(bucket),) and flat.dtype == torch.long
    x = views(flat, bucket)
    assert x.token_ids.tolist() == [[7, 0, 0], [8, 9, 10], [0, 0, 0]]
    assert x.positions.tolist() == [[5, 0, 0], [2, 3, 4], [0, 0, 0]]
    # padding rows take scratch slots 40.. in (sequence, row) order
    assert x.slots.tolist() == [[1 * 4 + 1, 41, 42], [10, 11, 12], [46, 47, 40]]
    assert x.tables.tolist() == [[3, 1], [2, 10], [10, 10]]  # past the sequence's blocks: the first scratch block
    assert x.past_lens.tolist() == [5, 2, 0]
    assert x.row_mask.tolist() == [[[1, 0, 0], [0, 1, 0], [0, 0, 1]],
                                   [[1, 0, 0], [1, 1, 0], [1, 1, 1]],
                                   [[1, 0, 0], [0, 1, 0], [0, 0, 1]]]
    assert x.first_row.tolist() == [0, 0, 0] and x.drafts.tolist() == [0, 2, 0]
    assert x.chain_slots.shape == (3, 0)


def test_a_tree_keeps_its_mask_and_positions() -> None:
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, two children
    tree = SeqInput([5, 6, 7], past_len=4, block_table=[0, 1], slot_mapping=[4, 5, 6], positions=[4, 5, 5],
                    attn_mask=mask)
    x = views(stage([tree], [0], Bucket(1, 3, 1), BLOCK, SCRATCH), Bucket(1, 3, 1))
    assert x.positions.tolist() == [[4, 5, 5]]
    assert x.row_mask[0].bool().equal(mask)


def test_a_draft_chain_reads_its_rows_through_the_table() -> None:
    seq = SeqInput([5, 6], past_len=3, block_table=[2, 7], slot_mapping=[11, 28])  # positions 3, 4
    assert needed_blocks(seq, BLOCK, chain=3) == 2  # the chain's steps read positions up to 3 + 2 + 1 - 1
    bucket = Bucket(1, 2, 2)
    x = views(stage([seq], [0], bucket, BLOCK, SCRATCH, chain=3, chain_slots=[[29, 30]]), bucket, chain=3)
    assert x.chain_slots.tolist() == [[29, 30]] and x.first_row.tolist() == [1]
    with pytest.raises(AssertionError, match="follow its table"):
        stage([seq], [0], bucket, BLOCK, SCRATCH, chain=3, chain_slots=[[29, 31]])


def test_a_step_past_its_bucket_is_refused() -> None:
    seq = SeqInput([1, 2], past_len=9, block_table=[0, 1, 2], slot_mapping=[9, 10])
    with pytest.raises(AssertionError):
        stage([seq], [0], Bucket(1, 1, 3), BLOCK, SCRATCH)  # two rows in a one-row bucket
    with pytest.raises(AssertionError):
        stage([seq], [0], Bucket(1, 2, 2), BLOCK, SCRATCH)  # three blocks of past in a two-block bucket
