"""Capture: the CUDA modes refuse a CPU device; warm-up makes every bucket's program and times it; on a CUDA device
(scripts/gpu-check.sh) one CUDA graph per bucket, replayed, equals the eager program on the same inputs (the
capture itself needs CUDA: skipped here with the reason)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_runtime.graph.buckets import Buckets
from model_runtime.graph.capture import CapturedSteps
from model_runtime.graph.local_loop import chain_step
from model_runtime.graph.runner import CapturedRunner
from model_runtime.model import CausalLM
from tests.model_runtime.graph.scenarios import BLOCK, NUM_BLOCKS, free_all, mixed_step, prefilled
from tests.model_runtime.random_checkpoint import make_random_checkpoint

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: CUDA graph capture needs one (scripts/gpu-check.sh runs it)")
BUCKETS = Buckets(batches=(1, 4), rows=(1, 5), blocks=(8,))
CHAIN = 3


@pytest.mark.parametrize("mode", ["cuda-graph", "compile+cuda-graph", "reduce-overhead"])
def test_cuda_modes_refuse_a_cpu_device(mode: str) -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CapturedSteps(lambda x: (x.token_ids,), torch.device("cpu"), mode)  # type: ignore[arg-type]


def test_warm_up_makes_and_times_every_bucket(tmp_path: Path) -> None:
    runner = CapturedRunner(CausalLM.load(make_random_checkpoint(tmp_path, seed=3)), NUM_BLOCKS, BLOCK, BUCKETS,
                            chain=CHAIN)
    report = runner.warm_up()
    assert sorted(report["verify"].seconds) == runner.verify.buckets == BUCKETS.all()
    assert runner.draft is not None and sorted(report["draft"].seconds) == runner.draft.buckets
    assert [b.rows for b in runner.draft.buckets] == [1, 1]  # a chain's catch-up: one row by default
    assert all(s > 0 for r in report.values() for s in r.seconds.values())
    assert report["verify"].memory_bytes == 0  # no CUDA memory on the CPU
    # warm-up wrote only the scratch blocks: the ledger's blocks are as allocated (zeros)
    assert all(not t[:NUM_BLOCKS].any() for t in (*runner.kv.k, *runner.kv.v))


def run_both(model: CausalLM, mode: str) -> list[tuple[object, object, object]]:
    outs = []
    for runner_mode in ("eager", mode):
        runner = CapturedRunner(model, NUM_BLOCKS, BLOCK, BUCKETS, mode=runner_mode, chain=CHAIN)  # type: ignore[arg-type]
        runner.warm_up()
        alloc, seqs = prefilled(runner)
        logits = [t.cpu() for t in runner.forward_seqs(mixed_step(alloc, seqs))]
        verdicts = runner.verify_greedy([alloc.extend(seq, [3, 4]) for seq in seqs], [1, 1, 1])
        catch_up, slots = chain_step(alloc, seqs, [[40], [41], [42]], CHAIN)
        outs.append((logits, verdicts, runner.draft_greedy(catch_up, slots)))
        free_all(alloc, seqs)
    return outs


@needs_cuda
@pytest.mark.parametrize("mode", ["cuda-graph", "compile+cuda-graph", "reduce-overhead"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_replay_the_eager_step(mode: str, dtype: torch.dtype, tmp_path: Path) -> None:
    model = CausalLM.load(make_random_checkpoint(tmp_path, seed=3), device="cuda", dtype=dtype)
    (want_logits, want_verdicts, want_drafts), (logits, verdicts, drafts) = run_both(model, mode)
    for got, want in zip(logits, want_logits, strict=True):  # type: ignore[call-overload]
        if mode == "cuda-graph":  # the same kernels replayed
            assert got.equal(want)
        else:  # inductor's fused kernels
            spread = (want.max() - want.min()).item()
            assert (got - want).abs().max().item() <= (2e-5 if dtype == torch.float32 else 0.01 * spread)
        assert got.argmax(-1).equal(want.argmax(-1))
    assert verdicts == want_verdicts and drafts == want_drafts
