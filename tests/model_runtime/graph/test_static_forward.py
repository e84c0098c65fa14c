"""The static-shape forward against the eager one (model.py) on the same inputs: a decode, a chain's verify and a
token tree in one padded step, float32 and bfloat16, Qwen2 and Llama shapes.

Not bitwise: the eager CPU forward runs the portable kernels' linears and attention (a row's sums in their own
order), this one F.linear and float32 products over the bucket's key width. Bounds (measured on this project's
EPYC, 2026-12-07: 1.2e-6 float32, 7.6e-3 bfloat16 on logits spanning ~5): float32 max |diff| <= 2e-5; bfloat16
<= 1% of the logits' spread; the greedy token equal in every row.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from model_runtime.graph.buckets import Bucket, Buckets
from model_runtime.graph.runner import CapturedRunner
from model_runtime.graph.static_forward import NotCapturableError, StaticModel
from model_runtime.model import CausalLM
from tests.model_runtime.graph.scenarios import (
    BLOCK,
    NUM_BLOCKS,
    eager_on_copy,
    free_all,
    mixed_step,
    pool_copy,
    prefilled,
)
from tests.model_runtime.random_checkpoint import make_random_checkpoint

FP32_TOL = 2e-5
BF16_RELATIVE = 0.01
BUCKETS = Buckets(batches=(1, 4), rows=(1, 5), blocks=(8,))


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == torch.float32
        diff = (g - w).abs().max().item()
        bound = FP32_TOL if dtype == torch.float32 else BF16_RELATIVE * (w.max() - w.min()).item()
        assert diff <= bound, (diff, bound)
        assert g.argmax(-1).equal(w.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_padded_step_equals_the_eager_forward(arch: str, dtype: torch.dtype, tmp_path: Path) -> None:
    model = CausalLM.load(make_random_checkpoint(tmp_path, arch=arch, seed=3), dtype=dtype)
    runner = CapturedRunner(model, NUM_BLOCKS, BLOCK, BUCKETS)
    runner.warm_up()
    alloc, seqs = prefilled(runner)
    step = mixed_step(alloc, seqs)
    eager_kv = pool_copy(runner.kv)
    want = model.forward_seqs(step, eager_kv)
    assert runner.verify.buckets == BUCKETS.all()
    got = runner.forward_seqs(step)  # bucket (4, 5, 8): a padding sequence, padding rows
    assert_close(got, want, dtype)
    # the pool: the step's slots hold the eager forward's K/V (within rounding), every other granted slot is as it
    # was; only padding rows wrote the scratch blocks past the ledger's
    written = torch.tensor([s for seq in step for s in seq.slot_mapping])
    kept = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    kept[written] = False
    for ours, theirs in zip((*runner.kv.k, *runner.kv.v), (*eager_kv.k, *eager_kv.v), strict=True):
        ours, theirs = ours[:NUM_BLOCKS].flatten(0, 1), theirs[:NUM_BLOCKS].flatten(0, 1)
        assert ours[kept].equal(theirs[kept])
        bound = FP32_TOL if dtype == torch.float32 else BF16_RELATIVE * theirs.float().abs().max().item()
        assert (ours[written].float() - theirs[written].float()).abs().max().item() <= bound
    free_all(alloc, seqs)


def test_each_sequence_gets_the_rows_it_asks_for(tmp_path: Path) -> None:
    model = CausalLM.load(make_random_checkpoint(tmp_path, seed=5))
    runner = CapturedRunner(model, NUM_BLOCKS, BLOCK, BUCKETS)
    runner.warm_up(verify=[Bucket(4, 5, 8)])
    alloc, seqs = prefilled(runner)
    step = mixed_step(alloc, seqs)
    step = [step[0], dataclasses.replace(step[1], logits=2), dataclasses.replace(step[2], logits="last")]
    want = eager_on_copy(model, runner.kv, step)
    got = runner.forward_seqs(step)
    assert [g.shape[0] for g in got] == [1, 2, 1]
    assert_close(got, want, torch.float32)
    free_all(alloc, seqs)


def test_packed_and_tensor_parallel_models_are_refused(tmp_path: Path) -> None:
    model = CausalLM.load(make_random_checkpoint(tmp_path, seed=5))
    kv = model.allocate_kv(4, BLOCK)
    model.tp_size = 2  # as a rank of two would be
    with pytest.raises(NotCapturableError, match="one rank"):
        StaticModel.of(model, kv)
    model.tp_size = 1
    model.weights.layers[0].o = model.weights.layers[0].o.half()  # not float32/bfloat16
    with pytest.raises(NotCapturableError, match="plain float32/bfloat16"):
        StaticModel.of(model, kv)
