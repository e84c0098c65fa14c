"""TPRank's seam to the captured step: without a plan the eager forward on a pool of the ledger's blocks (as it
always ran); with one, a CapturedRunner over the same model whose pool is the rank's (the ledger's blocks, then
scratch), its buckets made at start-up, a step inside them captured and one past them eager; one rank only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_runtime.batch import SeqInput
from model_runtime.graph.buckets import Buckets
from model_runtime.graph.modes import CapturePlan, CaptureUnsupportedError
from model_runtime.tp import TPRank
from tests.model_runtime.random_checkpoint import make_random_checkpoint

BLOCKS, BLOCK = 16, 4


def test_without_a_plan_the_eager_forward(tmp_path: Path) -> None:
    rank = TPRank(make_random_checkpoint(tmp_path, seed=5), 0, 1, BLOCKS, BLOCK)
    assert rank.captured is None and rank.kv.k[0].shape[0] == BLOCKS


def test_a_plan_routes_the_steps_through_the_runner(tmp_path: Path) -> None:
    checkpoint = make_random_checkpoint(tmp_path, seed=5)
    plan = CapturePlan("eager", Buckets(batches=(1,), rows=(1, 2), blocks=(4,)))
    rank, eager = TPRank(checkpoint, 0, 1, BLOCKS, BLOCK, capture=plan), TPRank(checkpoint, 0, 1, BLOCKS, BLOCK)
    assert rank.captured is not None and rank.kv is rank.captured.kv and rank.kv.k[0].shape[0] > BLOCKS
    assert sorted(rank.capture_warm_up["verify"].seconds) == plan.buckets.all()
    prompt = SeqInput([3, 1, 4, 1, 5, 9], 0, [0, 1], list(range(6)), logits="last")  # 6 rows: past the buckets
    decode = SeqInput([2], 6, [0, 1], [6], logits="last")
    runs = []
    run = rank.captured.verify.run
    rank.captured.verify.run = lambda *args: runs.append(args[0]) or run(*args)  # type: ignore[method-assign]
    for step in (prompt, decode):
        (got,), (want,) = rank.forward([step]), eager.forward([step])
        assert got.shape == want.shape and torch.allclose(got, want, atol=2e-5)
    assert [(b.batch, b.rows, b.blocks) for b in runs] == [(1, 1, 4)]  # the decode, captured; the prefill eager


def test_one_rank_only(tmp_path: Path) -> None:
    with pytest.raises(CaptureUnsupportedError, match="one rank"):  # before any weight loads or group forms
        TPRank(tmp_path / "absent", 0, 2, BLOCKS, BLOCK, capture=CapturePlan("eager", Buckets()))


def test_auto_falls_back_to_the_eager_forward_where_capture_fails(tmp_path: Path) -> None:
    """auto's plan (fallback) whose capture fails at start-up (here a CUDA graph on the CPU) leaves the rank on the
    eager forward over a pool of the ledger's blocks, the failure named; the same mode named outright is raised."""
    checkpoint = make_random_checkpoint(tmp_path, seed=5)
    buckets = Buckets(batches=(1,), rows=(1,), blocks=(4,))
    rank = TPRank(checkpoint, 0, 1, BLOCKS, BLOCK, capture=CapturePlan("cuda-graph", buckets, fallback=True))
    eager = TPRank(checkpoint, 0, 1, BLOCKS, BLOCK)
    assert rank.captured is None and rank.capture_failure is not None and "cuda-graph" in rank.capture_failure
    assert rank.kv.k[0].shape[0] == BLOCKS and rank.forward_kind.startswith("eager (capture failed: cuda-graph")
    step = SeqInput([3, 1, 4], 0, [0], [0, 1, 2], logits="last")
    (got,), (want,) = rank.forward([step]), eager.forward([step])
    assert torch.equal(got, want)
    with pytest.raises(Exception, match="CUDA|cuda"):
        TPRank(checkpoint, 0, 1, BLOCKS, BLOCK, capture=CapturePlan("cuda-graph", buckets))
