"""Buckets: the ladders a config allows, and the smallest bucket holding a step."""

from __future__ import annotations

from model_runtime.graph.buckets import Bucket, Buckets, smallest_holding


def test_up_to_ends_each_ladder_at_its_maximum() -> None:
    b = Buckets.up_to(max_batch=6, max_rows=9, max_context=2048, block_size=16)
    assert b.batches == (1, 2, 4, 6)
    assert b.rows == (1, 2, 3, 5, 9)
    assert b.blocks == (16, 64, 128)  # 256 tokens, x4, then the maximum (2048 / 16)
    assert len(b.all()) == 4 * 5 * 3


def test_up_to_with_a_context_below_the_first_rung() -> None:
    b = Buckets.up_to(max_batch=1, max_rows=4, max_context=100, block_size=16)
    assert b.batches == (1,) and b.rows == (1, 2, 3, 4) and b.blocks == (7,)


def test_smallest_holding_pads_each_dimension_up() -> None:
    every = Buckets(batches=(1, 2, 4), rows=(1, 3, 5), blocks=(4, 16)).all()
    assert smallest_holding(every, 1, 1, 0) == Bucket(1, 1, 4)
    assert smallest_holding(every, 3, 2, 5) == Bucket(4, 3, 16)
    assert smallest_holding(every, 2, 5, 16) == Bucket(2, 5, 16)
    assert smallest_holding(every, 5, 1, 1) is None  # batch past the largest
    assert smallest_holding(every, 1, 6, 1) is None  # a prefill: more rows than any bucket
    assert smallest_holding(every, 1, 1, 17) is None  # context past the largest
    assert smallest_holding([Bucket(1, 1, 4), Bucket(4, 5, 16)], 2, 1, 1) == Bucket(4, 5, 16)  # captured subset
