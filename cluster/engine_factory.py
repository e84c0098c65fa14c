"""Build a SpecEngine in this process: prepared models, one ledger, local verifier and drafter.

    specserve generate (in process):  engine -> {VerifierWorker(LocalRunner), DraftWorker(LocalRunner)}
                                      engine <-> LocalKV(BlockLedger)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.api import InvalidRequestError
from cluster.engine import EngineConfig, SpecEngine
from cluster.engine_warmup import warm_up
from cluster.kv_client import LocalKV
from drafter_service.worker import DraftWorker
from kv_manager.ledger import BlockLedger
from kv_manager.schema import NamespaceConfig
from model_runtime.config import ModelConfig
from model_runtime.tp import draft_dtype
from verifier_service.worker import LocalRunner, VerifierWorker

log = logging.getLogger("specserve.factory")

NON_MODEL_DRAFTS = ("ngram", "none")


class IncompatibleDraftError(InvalidRequestError):
    """Draft and target do not share the tokenizer / vocabulary mapping."""

    def __init__(self, message: str) -> None:
        super().__init__("draft", message)


@dataclass
class EngineOptions:
    max_batch: int = 8
    max_context: int = 2048
    block_size: int = 16
    num_blocks: int | None = None  # default: enough for max_batch full contexts
    k_max: int = 4
    device: str = "cpu"
    draft_dtype: str = "auto"  # see model_runtime.tp.draft_dtype
    warm_up: bool = False  # measure verify/draft costs before serving (cluster/engine_warmup.py)

    def blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_batch * (-(-self.max_context // self.block_size) + 1) + 16


def model_dir(name_or_path: str) -> Path:
    from model_runtime.prepare import prepare_model

    return Path(prepare_model(name_or_path))


def load_tokenizer(checkpoint_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint_dir))


def eos_token_ids(checkpoint_dir: Path, config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    ids = set(config.eos_token_ids)
    gen_cfg = checkpoint_dir / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def check_draft_compatible(target_cfg: ModelConfig, target_tok: Any, draft_cfg: ModelConfig, draft_tok: Any) -> None:
    """Refuse before any request runs unless draft and target share tokenizer and vocabulary ids."""
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise IncompatibleDraftError(
            f"vocabulary sizes differ: target {target_cfg.vocab_size}, draft {draft_cfg.vocab_size}")
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise IncompatibleDraftError("draft and target tokenizers map tokens to different ids")


def assemble_engine(
    model: str, draft: str, config: EngineConfig, num_blocks: int, block_size: int,
    make_verifier: Callable[[Path], Any], make_drafter: Callable[[Path], Any] | None,
    make_kv: Callable[[list[NamespaceConfig]], Any], tokenizer: Any = "auto",
) -> SpecEngine:
    """The one place an engine is wired: models, compatibility check, namespaces, EOS ids, context.

    In process the factories return local workers and a LocalKV; in the cluster, handles to the
    Verifier/Drafter deployments and a client of the KV manager actor.
    """
    target_dir = model_dir(model)
    target_cfg = ModelConfig.from_dir(target_dir)
    tok = load_tokenizer(target_dir) if tokenizer == "auto" else tokenizer
    namespaces = [NamespaceConfig(config.target_namespace, num_blocks, block_size)]
    drafter = None
    if draft not in NON_MODEL_DRAFTS:
        assert make_drafter is not None, "a draft model needs a drafter"
        draft_dir = model_dir(draft)
        draft_tok = load_tokenizer(draft_dir) if tokenizer == "auto" else tokenizer
        check_draft_compatible(target_cfg, tok, ModelConfig.from_dir(draft_dir), draft_tok)
        drafter = make_drafter(draft_dir)
        namespaces.append(NamespaceConfig(config.draft_namespace, num_blocks, block_size))
    config.max_context = min(config.max_context, target_cfg.max_position_embeddings)
    log.info("engine: target %s, draft %s, %d KV blocks of %d", model, draft, num_blocks, block_size)
    return SpecEngine(make_verifier(target_dir), drafter, make_kv(namespaces), tok,
                      eos_token_ids(target_dir, target_cfg, tok), target_cfg.vocab_size, config,
                      model_name=model, draft_name=draft)


def build_local_engine(model: str, draft: str = "none", options: EngineOptions | None = None,
                       tokenizer: Any = "auto") -> SpecEngine:
    """`model` and a model-valued `draft` are registry names or local HF checkpoint dirs."""
    opts = options or EngineOptions()
    blocks = opts.blocks()

    def runner(checkpoint_dir: Path, dtype: torch.dtype | None = None) -> LocalRunner:
        return LocalRunner(str(checkpoint_dir), blocks, opts.block_size, opts.device, dtype)

    config = EngineConfig(max_batch=opts.max_batch, k_max=opts.k_max, max_context=opts.max_context)
    engine = assemble_engine(
        model, draft, config, blocks, opts.block_size,
        make_verifier=lambda d: VerifierWorker(runner(d)),
        make_drafter=lambda d: DraftWorker(runner(d, draft_dtype(opts.draft_dtype, opts.device))),
        make_kv=lambda namespaces: LocalKV(BlockLedger(namespaces)), tokenizer=tokenizer,
    )
    if opts.warm_up:
        warm_up(engine)
    return engine
