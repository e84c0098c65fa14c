"""Draft/target compatibility: a draft whose tokenizer has the same vocabulary size as the target's but
maps tokens to other ids is refused before any worker is made (its drafts would be other tokens)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from cluster.engine.factory import (
    IncompatibleDraftError,
    assemble_engine,
    check_draft_compatible,
    load_tokenizer,
)
from model_runtime.config import ModelConfig
from tests.cluster.engine.engine_helpers import engine_config

TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def tokenizer_copy(source: Path, dest: Path, swap: tuple[str, str] | None = None) -> Path:
    """A checkpoint dir holding `source`'s config and tokenizer (no weights), with the ids of the two
    tokens in `swap` exchanged: the same vocabulary size, different ids."""
    dest.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, dest / name)
    if swap is not None:
        tokenizer = json.loads((dest / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        a, b = swap
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (dest / "tokenizer.json").write_text(json.dumps(tokenizer))
    return dest


@pytest.fixture(scope="module")
def permuted(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_copy(smollm2_dir, tmp_path_factory.mktemp("permuted") / "draft", swap=("hello", "world"))


def test_same_vocab_size_different_ids_refused(smollm2_dir: Path, permuted: Path, tmp_path: Path) -> None:
    target_tok, draft_tok = load_tokenizer(smollm2_dir), load_tokenizer(permuted)
    target_cfg, draft_cfg = ModelConfig.from_dir(smollm2_dir), ModelConfig.from_dir(permuted)
    assert target_cfg.vocab_size == draft_cfg.vocab_size and len(target_tok) == len(draft_tok)
    assert target_tok("hello")["input_ids"] != draft_tok("hello")["input_ids"]
    with pytest.raises(IncompatibleDraftError, match="different ids"):
        check_draft_compatible(target_cfg, target_tok, draft_cfg, draft_tok)
    same = tokenizer_copy(smollm2_dir, tmp_path / "same")  # an unchanged copy passes
    check_draft_compatible(target_cfg, target_tok, ModelConfig.from_dir(same), load_tokenizer(same))


@pytest.mark.parametrize("given_tokenizer", [False, True])
def test_engine_with_a_permuted_draft_tokenizer_refused_before_any_worker(smollm2_dir: Path, permuted: Path,
                                                                         given_tokenizer: bool) -> None:
    """Also when the caller hands the target's tokenizer in: the draft's own is what gets compared (it used to
    be compared with that same object, which never refuses)."""
    def never(*_: Any) -> Any:
        raise AssertionError("a worker or ledger was made for an incompatible pair")

    config = engine_config(max_batch=1, queue_capacity=1, max_context=64, max_verifier_failures=0)
    with pytest.raises(IncompatibleDraftError, match="different ids"):
        assemble_engine(str(smollm2_dir), str(permuted), config, 16, 16, make_verifier=never, make_drafter=never,
                        make_kv=never, tokenizer=load_tokenizer(smollm2_dir) if given_tokenizer else "auto")
