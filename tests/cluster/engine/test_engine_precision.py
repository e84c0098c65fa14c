"""Greedy speculative output equals plain greedy decoding of the same dtype, token by token, alone and in a
batch of 8 with k up to 8, on the real SmolLM2 weights, on every kernel path this CPU can run (the path is in the
test id: model_runtime/kernel_registry.py); the stats say which precision and kernels run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_runtime import cpu_kernels, precision
from model_runtime import kernel_registry as registry
from model_runtime.kernel_build import cpu_flags
from tests.cluster.engine.engine_helpers import local_engine, plain_greedy, request, run
from tests.cluster.engine.test_engine_models import EIGHT_PROMPTS


def check_equals_plain(smollm2_dir: Path, dtype: str, k: int, batch: int, draft: str = "model",
                       draft_dtype: str = "auto") -> None:
    engine = local_engine(smollm2_dir, smollm2_dir if draft == "model" else draft, max_batch=batch,
                          block_size=16, kv_blocks=256, dtype=dtype, draft_dtype=draft_dtype)
    prompts = [engine.tokenizer(t)["input_ids"] for t in EIGHT_PROMPTS]
    reqs = [request(f"r{i}", p, max_tokens=20, k=k, draft=draft) for i, p in enumerate(prompts)]
    got = run(engine, reqs)
    verify_rows = engine.stats()["cost_model"]["verify_seconds_by_tokens"]
    assert max(verify_rows) >= min(batch, 8) * (k + 1)  # the wide verifies ran
    eos = set(engine.eos_token_ids)
    for r, p in zip(reqs, prompts, strict=True):
        assert got[r.request_id] == plain_greedy(smollm2_dir, p, r.sampling.max_tokens, eos, dtype), r.request_id
    engine.kv.audit().assert_no_leaks()
    engine.check_ledger()


PATHS = [p.name for p in registry.PATHS  # the paths a forward can take (torch's is bounded, not exact)
         if {registry.LINEAR, registry.PACKED_LINEAR} & set(p.ops) and registry.cpu_has(p.name)]


@pytest.fixture(params=PATHS)
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test with SPECSERVE_CPU_KERNEL naming one path this CPU has (models load under it)."""
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", request.param)
    try:
        cpu_kernels.active()
    except ValueError as exc:
        pytest.skip(str(exc))
    return request.param


@pytest.mark.model
@pytest.mark.parametrize(("k", "batch", "draft"), [(8, 1, "model"), (8, 8, "model"), (3, 8, "model"), (4, 8, "ngram")])
def test_bf16_greedy_equals_plain_bf16(smollm2_dir: Path, kernel_path: str, k: int, batch: int, draft: str) -> None:
    """SmolLM2 drafting for itself: every draft is accepted, so each verify scores k+1 rows per request (72 at
    batch 8, k=8) against plain decoding's one; bf16 rows are bitwise batch-invariant, so the tokens match."""
    check_equals_plain(smollm2_dir, "bfloat16", k, batch, draft=draft)


# repetitive text, so the suffix trie proposes: token trees of up to 16 nodes (k = 4 levels)
TREE_PROMPTS = ["Alice went home. Bob went home. Carol went to school. Alice went", "1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2,",
                "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
                "red green blue red green yellow red green", "The cat sat. The dog sat. The cat ran. The",
                "x = 1\ny = 2\nx = 3\ny =", "one two three one two four one two", "a b c a b d a b"]


@pytest.mark.model
@pytest.mark.parametrize("batch", [1, 8])
def test_bf16_suffix_trees_equal_plain_bf16(smollm2_dir: Path, kernel_path: str, batch: int) -> None:
    """Token trees (suffix drafts) through the runtime's tree mask and the pool's slot moves: the accepted path's
    rows equal the chain's bit for bit, so greedy output equals plain decoding."""
    engine = local_engine(smollm2_dir, "suffix", max_batch=batch, block_size=16, kv_blocks=256, dtype="bfloat16")
    prompts = [engine.tokenizer(t)["input_ids"] for t in TREE_PROMPTS[:batch if batch > 1 else 3]]
    reqs = [request(f"r{i}", p, max_tokens=24, k=4, draft="suffix") for i, p in enumerate(prompts)]
    got = run(engine, reqs)
    eos = set(engine.eos_token_ids)
    for r, p in zip(reqs, prompts, strict=True):
        assert got[r.request_id] == plain_greedy(smollm2_dir, p, 24, eos, "bfloat16"), r.request_id
    stats = engine.acceptance
    assert stats.tree_rounds > 0 and stats.accepted > 0, stats


@pytest.mark.model
def test_bf16_draft_model_trees_equal_plain_bf16(smollm2_dir: Path, kernel_path: str) -> None:
    """A draft model's token trees (model_tree_nodes; drafter_service/draft_tree.py): its fed nodes go through the
    drafter's tree mask and scratch slots, the target verifies the tree in one forward, batch 8."""
    engine = local_engine(smollm2_dir, smollm2_dir, max_batch=8, block_size=16, kv_blocks=256, dtype="bfloat16",
                          model_tree_nodes=10)
    prompts = [engine.tokenizer(t)["input_ids"] for t in EIGHT_PROMPTS]
    reqs = [request(f"r{i}", p, max_tokens=16, k=3, draft="model") for i, p in enumerate(prompts)]
    got = run(engine, reqs)
    eos = set(engine.eos_token_ids)
    for r, p in zip(reqs, prompts, strict=True):
        assert got[r.request_id] == plain_greedy(smollm2_dir, p, 16, eos, "bfloat16"), r.request_id
    assert engine.acceptance.tree_rounds == engine.acceptance.rounds > 0


@pytest.mark.model
def test_float32_greedy_equals_plain_float32_on_every_path(smollm2_dir: Path, kernel_path: str) -> None:
    check_equals_plain(smollm2_dir, "float32", 8, 8)


@pytest.mark.model
@pytest.mark.skipif(cpu_kernels.for_dtype(torch.bfloat16).packed is None,
                    reason=f"no kernel packs int8 weights here: {cpu_kernels.for_dtype(torch.bfloat16).packed_why}")
def test_int8_draft_changes_acceptance_never_the_output(smollm2_dir: Path) -> None:
    """An int8 draft (W8A8 on AMX) proposes other tokens than its bf16 self now and then; the output is still
    plain bf16 decoding, token by token, at batch 8."""
    check_equals_plain(smollm2_dir, "bfloat16", 4, 8, draft_dtype="int8")


@pytest.mark.model
def test_stats_name_the_precision(smollm2_dir: Path) -> None:
    engine = local_engine(smollm2_dir, smollm2_dir, max_batch=1, kv_blocks=32, dtype="float32",
                          draft_dtype="bfloat16")
    assert engine.stats()["dtype"] == {"target": "float32", "draft": "bfloat16"}
    ngram = local_engine(smollm2_dir, "ngram", max_batch=1, kv_blocks=32, dtype="auto")
    auto = "bfloat16" if precision.cpu_runs_own_kernels() or precision.cpu_has_bf16() else "float32"
    auto = "q4" if precision.auto_is_q4(smollm2_dir, "cpu", max_batch=1) else auto  # one stream, or no AMX
    assert ngram.stats()["dtype"] == {"target": auto}


QUANT_PATHS = [p.name for p in registry.PATHS  # each path with its own portable and q4 builds, where this CPU has both
               if {registry.LINEAR, registry.Q4_LINEAR} <= set(p.ops) and registry.cpu_has(p.name)
               and p.ops[registry.Q4_LINEAR].needs <= cpu_flags()]


@pytest.mark.model
@pytest.mark.parametrize(("k", "batch", "draft"), [(8, 1, "model"), (8, 8, "model"), (4, 8, "ngram")])
@pytest.mark.parametrize("path", QUANT_PATHS)
def test_q4_greedy_equals_plain_q4(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, path: str, k: int,
                                   batch: int, draft: str) -> None:
    """`--dtype q4`: the GGUF's own codes (SmolLM2: Q4_1 linears, a Q8_0 lm_head), activations quantized per row,
    so a row's logits are the same bits verified among 72 as decoded alone, on each quantized build."""
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", path)
    check_equals_plain(smollm2_dir, "q4", k, batch, draft=draft, draft_dtype="q4")
