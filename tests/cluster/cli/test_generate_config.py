"""`specserve generate` in process: its engine settings come from a ClusterConfig built from the flags
(a batch of --n up to GENERATE_MAX_BATCH, KV pools for the tokens that batch holds, never more than --n
full contexts, warm-up only under auto k); a bad model is a one-line error, exit status 2; without --max-tokens
the answer ends where the model ends it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli.generate import GENERATE_MAX_BATCH, generate_kv_blocks, in_process_config
from cluster.cli.main import build_parser, main
from cluster.serving.config import ClusterConfig


def settings_for(*flags: str, draft: str = "ngram") -> ClusterConfig:
    args = build_parser().parse_args(["generate", "hello", "--model", "smollm2-135m", *flags])
    return in_process_config(args, draft)


def test_flags_give_the_engine_settings() -> None:
    settings = settings_for("--n", "3", "--max-context", "100", "--draft-dtype", "float32")
    engine, runtime = settings.engine_config(), settings.local_runtime()
    assert (engine.max_batch, engine.max_context, engine.max_waiting, engine.k_max) == (3, 100, 256, 4)
    assert runtime.num_blocks == 3 * (-(-100 // 16) + 1) + 16 and runtime.block_size == 16
    assert (runtime.device, runtime.draft_dtype, runtime.warm_up) == ("cpu", "float32", True)


def test_many_completions_size_the_pools_by_their_own_tokens() -> None:
    """--n 3000 --max-tokens 4: a batch of 256 at a time, the queue takes all 3000, and each pool holds one
    full context (the shared prompt) + per running completion its 4 tokens + k_max + 1 in 3 blocks (its copy
    of the prompt's partial block, a boundary): 912 blocks, where 256 full contexts were 33_040."""
    settings = settings_for("--n", "3000", "--max-tokens", "4")
    engine, runtime = settings.engine_config(), settings.local_runtime()
    assert (engine.max_batch, engine.max_waiting) == (GENERATE_MAX_BATCH, 3000) == (256, 3000)
    assert runtime.num_blocks == generate_kv_blocks(256, 4, 2048, 4, 16) == 128 + 256 * 3 + 16
    assert settings.model_copy(update={"kv_blocks": None}).kv_pool_blocks == 256 * (128 + 1) + 16 == 33_040


def test_defaults_and_warm_up_only_under_auto_k() -> None:
    default = settings_for(draft="none")  # 'none' (no drafting) exists in process only
    assert (default.max_batch, default.max_context, default.kv_pool_blocks) == (1, 2048, 1 * (128 + 1) + 16)
    assert default.local_runtime().warm_up and default.local_runtime().draft_dtype == "auto"
    assert not settings_for("--k", "2").local_runtime().warm_up
    assert not settings_for("--no-warm-up").local_runtime().warm_up


def test_unknown_model_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hello", "--model", "no-such-model", "--draft", "ngram"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "unknown model 'no-such-model'" in err


def test_without_max_tokens_the_pools_hold_a_context_per_completion() -> None:
    assert build_parser().parse_args(["generate", "hello"]).max_tokens is None
    assert generate_kv_blocks(3, None, 2048, 4, 16) == generate_kv_blocks(3, 2048, 2048, 4, 16)
    assert settings_for().local_runtime().num_blocks == 1 * (128 + 1) + 16  # one full context, as before


def test_the_answer_ends_where_the_model_ends_it(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's quick start, on SmolLM2: no --max-tokens, and the answer runs to the model's end of sequence (the
    default of 64 tokens cut the quick start's answer mid-sentence)."""
    assert main(["generate", "What is 2 + 2?", "--chat", "--model", "smollm2-135m", "--draft", "ngram",
                 "--max-context", "256", "--no-warm-up", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (sample,) = result["samples"]
    assert sample["finish_reason"] == "eos" and "4" in sample["text"]
    assert len(sample["token_ids"]) < 256 - len(result["prompt_token_ids"])
