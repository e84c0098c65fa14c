"""The in-process engine with its workers' steps through captured programs (`capture`: model_runtime/graph/): greedy
speculative output equals plain decoding token for token, the steps inside the buckets ran captured, a prefill
ran the eager forward on the same pool, and no KV block is left behind (on the CPU: eager, and compile with
torch.compile's aot_eager backend)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from cluster.engine.engine import SpecEngine
from cluster.engine.factory import build_local_engine
from model_runtime.graph.buckets import Buckets
from model_runtime.graph.modes import CaptureUnsupportedError
from model_runtime.graph.runner import CapturedRunner
from tests.cluster.engine.engine_helpers import engine_settings, plain_greedy, random_pair, request, run


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return random_pair(tmp_path_factory.mktemp("pair"))


def captured_engine(target: Path, draft: Path | str, backend: str = "inductor", **fields: Any) -> SpecEngine:
    settings = engine_settings(dtype="float32", draft_dtype="float32", block_size=4, kv_blocks=256, **fields)
    runtime = dataclasses.replace(settings.local_runtime(), capture_backend=backend)
    return build_local_engine(str(target), str(draft), settings.engine_config(), runtime, tokenizer=None)


def count_runs(runner: CapturedRunner) -> dict[str, int]:
    """Counts the runner's captured runs and eager fallbacks from now on."""
    counts = {"captured": 0, "eager": 0}
    captured, eager = runner.verify.run, runner.model.forward_seqs

    def run_captured(*args: Any) -> Any:
        counts["captured"] += 1
        return captured(*args)

    def run_eager(*args: Any) -> Any:
        counts["eager"] += 1
        return eager(*args)

    runner.verify.run = run_captured  # type: ignore[method-assign]
    runner.model.forward_seqs = run_eager  # type: ignore[method-assign]
    return counts


def captured_runner(worker: Any) -> CapturedRunner:
    runner = worker.runner.rank.captured
    assert isinstance(runner, CapturedRunner)
    assert worker.runner.rank.kv is runner.kv  # the rank's pool is the runner's: moves and copies act on it
    return runner


@pytest.mark.parametrize("draft", ["model", "suffix"])
def test_eager_capture_equals_plain_decoding(pair: tuple[Path, Path], draft: str) -> None:
    target, draft_dir = pair
    engine = captured_engine(target, draft_dir if draft == "model" else draft, capture="eager", max_batch=4,
                             max_context=256)
    verifier = captured_runner(engine.verifier)
    assert verifier.buckets == Buckets((1, 2, 4), (1, 2, 3, 5), (64,))  # max_batch 4, k_max 4 + 1 rows, 256 tokens
    assert verifier.kv.k[0].shape[0] > 256  # the ledger's blocks, then the scratch blocks
    counts = {"verifier": count_runs(verifier)}
    if draft == "model":
        counts["drafter"] = count_runs(captured_runner(engine.drafter))
    prompts = [[9, 3, 4, 5, 9, 3, 4, 6, 9, 3, 4], [10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28], [7]]
    reqs = [request(f"r{i}", p, max_tokens=20 + i, k=1 + i % 3, draft=draft) for i, p in enumerate(prompts)]
    got = run(engine, reqs)  # every request ended with an empty ledger, no block leaked
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == plain_greedy(target, p, 20 + i, dtype="float32"), f"request r{i}"
    for role, count in counts.items():
        assert count["captured"] > 0 and count["eager"] > 0, (role, count)  # rounds captured, prefills eager
    if draft == "suffix":  # token trees: their accepted paths moved within the captured pool
        assert engine.acceptance.tree_rounds > 0 and engine.acceptance.accepted > 0


def test_compiled_capture_equals_plain_decoding(pair: tuple[Path, Path]) -> None:
    """torch.compile per bucket (aot_eager: compiled, not lowered): 3 buckets a model (batch 1 x 1..3 rows x 16
    blocks)."""
    target, draft_dir = pair
    engine = captured_engine(target, draft_dir, "aot_eager", capture="compile", max_batch=1, k_max=2,
                             max_context=64)
    verifier = captured_runner(engine.verifier)
    assert len(verifier.verify.buckets) == 3 and verifier.verify.mode == "compile"
    counts = count_runs(verifier)
    prompt = [9, 3, 4, 5, 9, 3]
    got = run(engine, [request("r", prompt, max_tokens=16, k=2)])
    assert got["r"] == plain_greedy(target, prompt, 16, dtype="float32")
    assert counts["captured"] > 0


def test_refused_before_anything_loads(pair: tuple[Path, Path]) -> None:
    target, draft_dir = pair
    with pytest.raises(CaptureUnsupportedError, match="not float16"):  # the draft's precision resolved first
        build_local_engine(str(target), str(draft_dir), engine_settings().engine_config(),
                           dataclasses.replace(engine_settings(dtype="float32").local_runtime(), capture="eager",
                                               draft_dtype="float16"), tokenizer=None)
