"""`specserve generate` in process: its engine settings come from a ClusterConfig built from the flags,
with the values the flags always gave (a batch of --n, KV pools for --n full contexts, warm-up only
under auto k); a bad model is a one-line error, exit status 2."""

from __future__ import annotations

import pytest

from cluster.cli.generate import in_process_config
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
