"""The captured step compiles whole: torch.compile(fullgraph=True, dynamic=False) of the target's verify program and
of the draft's greedy chain on every bucket the test config allows, one graph each and no break (the property CUDA
graph capture needs: no .item(), .tolist(), data-dependent shape or host read inside), and the compiled programs'
outputs equal the eager ones'.

Every bucket compiles with the aot_eager backend (Dynamo's trace and AOTAutograd's functionalized graph, the ops
run as they are: outputs and the pool bitwise the eager step's); one bucket per program with inductor (fused
kernels: other roundings, so within the static forward's bounds and the greedy tokens equal). The compile times
are on docs/gpu.md.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from model_runtime.graph.buckets import Bucket, Buckets
from model_runtime.graph.local_loop import chain_step
from model_runtime.graph.runner import CapturedRunner
from model_runtime.model import CausalLM
from tests.model_runtime.graph.scenarios import BLOCK, NUM_BLOCKS, free_all, mixed_step, prefilled
from tests.model_runtime.graph.test_static_forward import assert_close
from tests.model_runtime.random_checkpoint import make_random_checkpoint

TARGET = Buckets(batches=(1, 2, 4), rows=(1, 3, 5), blocks=(4, 8))  # 18 buckets
DRAFT = Buckets(batches=(1, 4), rows=(1,), blocks=(4, 8))  # the chain's catch-up of one row: 4 buckets
CHAIN = 3


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def twins(model: CausalLM, buckets: Buckets, backend: object, chain: int = 1) -> tuple[CapturedRunner, CapturedRunner]:
    """An eager runner and a compiled one over the same model (pools of their own, prefilled alike)."""
    return (CapturedRunner(model, NUM_BLOCKS, BLOCK, buckets, chain=chain),
            CapturedRunner(model, NUM_BLOCKS, BLOCK, buckets, mode="compile", chain=chain, backend=backend))


def test_the_target_verify_compiles_whole_on_every_bucket(tmp_path: Path) -> None:
    model = CausalLM.load(make_random_checkpoint(tmp_path, arch="qwen2", seed=3))
    counter = CompileCounterWithBackend("aot_eager")
    eager, compiled = twins(model, TARGET, counter)
    eager.warm_up()
    compiled.warm_up()  # fullgraph=True: a graph break raises here
    assert counter.frame_count == len(TARGET.all()) == 18  # one graph per bucket
    runs = []
    for runner in (eager, compiled):
        alloc, seqs = prefilled(runner)
        step = mixed_step(alloc, seqs)
        runs.append((runner.forward_seqs(step), runner.verify_greedy(step, [0, 3, 0])))
        free_all(alloc, seqs)
    (want, want_verdicts), (got, got_verdicts) = runs
    assert all(g.equal(w) for g, w in zip(got, want, strict=True))
    assert got_verdicts == want_verdicts
    assert all(a.equal(b) for a, b in zip((*eager.kv.k, *eager.kv.v), (*compiled.kv.k, *compiled.kv.v), strict=True))
    assert counter.frame_count == 18  # the steps ran the compiled buckets: no recompile


def test_the_draft_chain_compiles_whole_on_every_bucket(tmp_path: Path) -> None:
    model = CausalLM.load(make_random_checkpoint(tmp_path, arch="llama", seed=4, num_layers=1))
    counter = CompileCounterWithBackend("aot_eager")
    eager, compiled = twins(model, DRAFT, counter, chain=CHAIN)
    eager.warm_up(verify=[])
    compiled.warm_up(verify=[])
    assert counter.frame_count == len(DRAFT.all()) == 4
    drafts = []
    for runner in (eager, compiled):
        alloc, seqs = prefilled(runner)
        catch_up, slots = chain_step(alloc, seqs, [[40], [41], [42]], CHAIN)
        drafts.append(runner.draft_greedy(catch_up, slots))
        free_all(alloc, seqs)
    assert drafts[0] == drafts[1] and all(len(d) == CHAIN for d in drafts[0])
    assert counter.frame_count == 4


@pytest.mark.parametrize("chain", [1, CHAIN])
def test_inductor_compiles_a_bucket_within_the_bounds(chain: int, tmp_path: Path) -> None:
    """Inductor's fused kernels on one bucket of each program (~45 s each on 2 shared vCPUs)."""
    model = CausalLM.load(make_random_checkpoint(tmp_path, arch="qwen2", seed=3, num_layers=1))
    bucket = Bucket(4, 5, 8) if chain == 1 else Bucket(4, 1, 8)
    eager, compiled = twins(model, Buckets((4,), (bucket.rows,), (8,)), "inductor", chain=chain)
    started = time.perf_counter()
    for runner in (eager, compiled):
        runner.warm_up(verify=[bucket] if chain == 1 else [], draft=[bucket] if chain > 1 else None)
    print(f"inductor, chain {chain}: {time.perf_counter() - started:.1f} s to compile {bucket}")
    outs = []
    for runner in (eager, compiled):
        alloc, seqs = prefilled(runner)
        if chain == 1:
            outs.append(runner.forward_seqs(mixed_step(alloc, seqs)))
        else:
            catch_up, slots = chain_step(alloc, seqs, [[40], [41], [42]], chain)
            outs.append(runner.draft_greedy(catch_up, slots))
        free_all(alloc, seqs)
    if chain == 1:
        assert_close(outs[1], outs[0], torch.float32)
    else:
        assert outs[1] == outs[0]


def test_two_runners_compile_all_their_buckets_in_one_process(tmp_path: Path) -> None:
    """Dynamo counts recompiles per code object: every runner's programs share one, so each warm-up makes room for
    its own buckets (12 here, past the default limit of 8)."""
    model = CausalLM.load(make_random_checkpoint(tmp_path, seed=3, num_layers=1))
    buckets = Buckets(batches=(1, 2), rows=(1, 3, 5), blocks=(4,))
    for _ in range(2):
        runner = CapturedRunner(model, NUM_BLOCKS, BLOCK, buckets, mode="compile", backend="aot_eager")
        assert len(runner.warm_up()["verify"].seconds) == 6
