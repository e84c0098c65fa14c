"""Build a SpecEngine in this process: prepared models, one ledger, local verifier and drafter.

    specserve generate (in process):  engine -> {VerifierWorker(LocalRunner), DraftWorker(LocalRunner)}
                                      engine <-> LocalKV(BlockLedger)

A LocalRunner runs the eager forward, or with `LocalRuntime.capture` resolved to a mode, captured programs per
bucket (model_runtime/graph/), made as the runner starts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE, EngineConfig
from cluster.engine.engine import SpecEngine
from cluster.engine.kv_client import LocalKV
from cluster.engine.step_record import EngineObserver
from cluster.engine.warmup import warm_up
from drafter_service.draft_constraints import DraftConstraints, tokenizer_compiler
from drafter_service.worker import DraftWorker
from kv_manager.ledger import BlockLedger
from kv_manager.schema import NamespaceConfig
from model_runtime.config import ModelConfig, eos_token_ids
from model_runtime.graph.modes import CapturePlan, CaptureSettings, capture_mode
from model_runtime.precision import draft_dtype, dtype_name, target_dtype
from specserve_types.api import InvalidRequestError, SpecServeError
from verifier_service.worker import LocalRunner, VerifierWorker

log = logging.getLogger("specserve.factory")

NON_MODEL_DRAFTS = ("ngram", "suffix", "none")


class IncompatibleDraftError(InvalidRequestError):
    """Draft and target do not share the tokenizer / vocabulary mapping."""

    def __init__(self, message: str) -> None:
        super().__init__("draft", message)


@dataclass(frozen=True)
class LocalRuntime:
    """What an in-process engine needs beyond EngineConfig, all required: their defaults and meanings
    live in `ClusterConfig` (cluster/serving/config.py), whose `local_runtime()` builds this."""

    block_size: int  # tokens per KV block
    num_blocks: int  # blocks per KV pool (target and draft)
    device: str  # torch device of the local verifier and drafter
    dtype: str  # the target's precision: see model_runtime.precision.target_dtype
    draft_dtype: str  # see model_runtime.precision.draft_dtype
    warm_up: bool  # measure verify/draft costs before serving (cluster/engine/warmup.py)
    capture: str = "off"  # the workers' forward: off, auto or a capture mode (model_runtime/graph/modes.py)
    capture_backend: str = "inductor"  # torch.compile's backend for the compile modes (tests: aot_eager)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError(f"block_size and num_blocks must be positive: {self}")
        if not self.device:
            raise ValueError(f"device must be non-empty: {self}")
        capture_mode(self.capture, self.device)  # CaptureUnsupportedError: unknown, or a CUDA mode off CUDA


def model_dir(name_or_path: str) -> Path:
    from model_runtime.prepare import prepare_model

    return Path(prepare_model(name_or_path))


def load_tokenizer(checkpoint_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint_dir))


def tokenize_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if not prompt:
        raise SpecServeError("prompt: must be non-empty")
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer(prompt)["input_ids"])


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
    make_kv: Callable[[list[NamespaceConfig]], Any], tokenizer: Any = "auto", dtypes: Mapping[str, str] | None = None,
    observer: EngineObserver | None = None,
) -> SpecEngine:
    """The one place an engine is wired: models, compatibility check, namespaces, EOS ids, context.

    In process the factories return local workers and a LocalKV; in the cluster, handles to the
    Verifier/Drafter deployments and a client of the KV manager actor.
    """
    target_dir = model_dir(model)
    target_cfg = ModelConfig.from_dir(target_dir)
    tok = load_tokenizer(target_dir) if tokenizer == "auto" else tokenizer
    namespaces = [NamespaceConfig(TARGET_NAMESPACE, num_blocks, block_size)]
    drafter = None
    if draft not in NON_MODEL_DRAFTS:
        assert make_drafter is not None, "a draft model needs a drafter"
        draft_dir = model_dir(draft)
        draft_tok = None if tok is None else load_tokenizer(draft_dir)  # its own, never the target's
        check_draft_compatible(target_cfg, tok, ModelConfig.from_dir(draft_dir), draft_tok)
        drafter = make_drafter(draft_dir)
        namespaces.append(NamespaceConfig(DRAFT_NAMESPACE, num_blocks, block_size))
    config = dataclasses.replace(config, max_context=min(config.max_context, target_cfg.max_position_embeddings))
    log.info("engine: target %s, draft %s, %d KV blocks of %d", model, draft, num_blocks, block_size)
    return SpecEngine(make_verifier(target_dir), drafter, make_kv(namespaces), tok,
                      eos_token_ids(target_dir, target_cfg, tok), target_cfg.vocab_size, config,
                      model_name=model, draft_name=draft,
                      dtypes={name: d for name, d in (dtypes or {}).items() if name == "target" or drafter is not None},
                      observer=observer)


def fresh_engine(base: SpecEngine, config: EngineConfig, observer: EngineObserver | None = None,
                 cost: Any = None, acceptance: Any = None, lookup_acceptance: Any = None) -> SpecEngine:
    """An engine on `base`'s workers, tokenizer and constraint compiler with a fresh in-process ledger of the same pools
    (no prefix cache carried over): a benchmark's run of one config, carrying that config's policy state."""
    namespaces = [pool.config for pool in base.kv.inner.ledger.pools.values()]
    return SpecEngine(base.verifier, base.drafter, LocalKV(BlockLedger(namespaces)), base.tokenizer,
                      tuple(base.eos_token_ids), base.vocab_size, config, model_name=base.model_name,
                      draft_name=base.draft_name, dtypes=base.dtypes, observer=observer, cost=cost,
                      acceptance=acceptance, lookup_acceptance=lookup_acceptance, constraints=base.constraints)


def max_positions(model: str) -> int:
    """The model's own context limit (its config's max_position_embeddings)."""
    return ModelConfig.from_dir(model_dir(model)).max_position_embeddings


def draft_worker(runner: LocalRunner, checkpoint_dir: Path) -> DraftWorker:
    """The draft model's worker, drafting constrained chains under their constraints (its own tokenizer's matchers)."""
    return DraftWorker(runner, DraftConstraints(tokenizer_compiler(str(checkpoint_dir), runner.config.vocab_size),
                                                prebuild=True))


def build_local_engine(model: str, draft: str, config: EngineConfig, runtime: LocalRuntime,
                       tokenizer: Any = "auto", observer: EngineObserver | None = None) -> SpecEngine:
    """`model` and a model-valued `draft` are registry names or local HF checkpoint dirs; `config` and
    `runtime` come from a ClusterConfig (`engine_config()`, `local_runtime()`)."""

    # auto reads the models (precision.py: q4 where it is the fastest exact path)
    target = target_dtype(runtime.dtype, runtime.device, model_dir(model), max_batch=config.max_batch)
    drafts = draft_dtype(runtime.draft_dtype, runtime.device, model_dir(draft) if draft not in NON_MODEL_DRAFTS else None)
    # the workers' forward (model_runtime/graph/modes.py), refused before anything loads where it cannot run
    capture = CaptureSettings(runtime.capture, config.max_batch, config.k_max, config.max_context,
                              runtime.capture_backend)
    target_plan = capture.plan(runtime.device, 1, dtype_name(target), runtime.block_size, max_positions(model))
    draft_plan = None if draft in NON_MODEL_DRAFTS else \
        capture.plan(runtime.device, 1, dtype_name(drafts), runtime.block_size, max_positions(draft))

    def runner(checkpoint_dir: Path, dtype: torch.dtype, plan: CapturePlan | None) -> LocalRunner:
        return LocalRunner(str(checkpoint_dir), runtime.num_blocks, runtime.block_size, runtime.device, dtype, plan)

    engine = assemble_engine(
        model, draft, config, runtime.num_blocks, runtime.block_size,
        make_verifier=lambda d: VerifierWorker(runner(d, target, target_plan)),
        make_drafter=lambda d: draft_worker(runner(d, drafts, draft_plan), d),
        make_kv=lambda namespaces: LocalKV(BlockLedger(namespaces)), tokenizer=tokenizer,
        dtypes={"target": dtype_name(target), "draft": dtype_name(drafts)}, observer=observer,
    )
    if runtime.warm_up:
        warm_up(engine)
    return engine
