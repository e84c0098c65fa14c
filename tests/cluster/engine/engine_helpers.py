"""Shared helpers for engine tests: plain greedy reference decoding, engine runs, and a model-free engine.

The model-free engine (`fake_engine`) runs the real engine, ledger and workers over `FakeRunner`s: a
paged token pool instead of a model, so a wrong block table, slot mapping or stale cache shows up as a
wrong token, as with a real model, at no cost. Its target decodes greedily by `fake_next_token`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE, EngineConfig
from cluster.engine.engine import SpecEngine
from cluster.engine.factory import build_local_engine
from cluster.engine.kv_client import LocalKV
from cluster.engine.spec_policy import CostModel
from cluster.serving.config import ClusterConfig
from drafter_service.worker import DraftWorker
from kv_manager.ledger import BlockLedger
from kv_manager.schema import NamespaceConfig
from model_runtime.batch import SeqInput
from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from model_runtime.precision import target_dtype
from model_runtime.prepare import cached_path
from model_runtime.registry import resolve_model
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams
from tests.model_runtime.random_checkpoint import make_random_checkpoint
from verifier_service.worker import VerifierWorker

FAKE_VOCAB = 97


def random_pair(root: Path, seeds: tuple[int, int] = (1, 2)) -> tuple[Path, Path]:
    """A random Qwen2-shaped target and a one-layer random draft of the same 64-token vocabulary under `root`."""
    return (make_random_checkpoint(root / "target", arch="qwen2", seed=seeds[0], vocab_size=64),
            make_random_checkpoint(root / "draft", arch="qwen2", seed=seeds[1], vocab_size=64, num_layers=1))


def engine_settings(**fields: Any) -> ClusterConfig:
    """A test engine's settings: ClusterConfig (the one place defaults live) with `fields`; KV pools sized
    for max_batch full contexts unless kv_blocks is given, and no warm-up unless asked."""
    return ClusterConfig(**{"model": "smollm2-135m", "draft": "ngram", "kv_blocks": None, "warm_up": False,
                            **fields})


def engine_config(**fields: Any) -> EngineConfig:
    """EngineConfig from ClusterConfig fields (queue_capacity sets max_waiting)."""
    return engine_settings(**fields).engine_config()


def local_engine(target: Path | str, draft: Path | str, tokenizer: Any = "auto", observer: Any = None,
                 **fields: Any) -> SpecEngine:
    """build_local_engine(target, draft) with the settings of `engine_settings(**fields)`; `draft` is a
    checkpoint, 'ngram' or 'none'."""
    settings = engine_settings(**fields)
    return build_local_engine(str(target), str(draft), settings.engine_config(), settings.local_runtime(),
                              tokenizer=tokenizer, observer=observer)


def load_target(checkpoint: Path | str, dtype: str = "auto") -> CausalLM:
    """The target as an engine built with ClusterConfig's `dtype` runs it (auto: model_runtime/precision.py)."""
    return CausalLM.load(checkpoint, dtype=target_dtype(dtype, "cpu", checkpoint))


def plain_greedy(checkpoint: Path, prompt: list[int], max_tokens: int, eos: set[int] | None = None,
                 dtype: str = "auto") -> list[int]:
    """Plain greedy target decoding with our runtime (itself checked against transformers), one token per
    forward, in the precision an engine of that `dtype` runs."""
    model = load_target(checkpoint, dtype)
    alloc = LocalAllocator(256, 16)
    kv = model.allocate_kv(256, 16)
    seq = LocalSequence()
    (logits,) = model.forward_seqs([alloc.extend(seq, prompt, logits="last")], kv)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(torch.argmax(logits[-1]))
        out.append(token)
        if eos and token in eos:
            break
        (logits,) = model.forward_seqs([alloc.extend(seq, [token])], kv)
    return out


def request(rid: str, prompt: list[int], max_tokens: int = 24, k: int | None = 3, draft: str = "model",
            contract: str = "greedy", temperature: float = 0.0, seed: int | None = None, **sampling) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(prompt),
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, **sampling),
        SpecParams(contract=contract, k=k, draft=draft),
    )


def run(engine: SpecEngine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    for r in requests:
        engine.submit(r)
    chunks = engine.run_to_completion()
    engine.check_ledger()  # every request ended: nothing left in any namespace
    engine.kv.audit().assert_no_leaks()
    return {rid: [t for c in cs for t in c.token_ids] for rid, cs in chunks.items()}


# ---------------------------------------------------------------------- the model-free engine
def fake_next_token(sequence: list[int]) -> int:
    """The fake target's greedy choice after `sequence`: depends on every token (a stale slot shows)."""
    return (7 * sequence[-1] + 3 * len(sequence) + sum(sequence)) % FAKE_VOCAB


def fake_draft_token(sequence: list[int]) -> int:
    """The fake drafter: the target's choice, wrong at every third position (partial acceptance)."""
    token = fake_next_token(sequence)
    return (token + 1) % FAKE_VOCAB if len(sequence) % 3 == 0 else token


def fake_greedy(prompt: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding of the fake target."""
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(fake_next_token(sequence))
    return sequence[len(prompt):]


@dataclass
class FakeModelConfig:
    vocab_size: int


class FakeRunner:
    """A ForwardRunner without a model: new tokens are written to their slots of a paged token pool;
    each logits row is a one-hot at `rule(the sequence read back through the block table)`."""

    def __init__(self, rule: Callable[[list[int]], int | list[int]], block_size: int) -> None:
        self.rule = rule
        self.block_size = block_size
        self.config = FakeModelConfig(FAKE_VOCAB)
        self.pool: dict[int, int] = {}  # slot -> token

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def forward(self, seqs: list[SeqInput], copy_blocks: list[tuple[int, int]],
                slot_moves: tuple[tuple[int, int], ...] = ()) -> list[torch.Tensor]:
        bs = self.block_size
        moved = {dst: self.pool[src] for src, dst in slot_moves}  # every source read before any write
        self.pool.update(moved)
        for src, dst in copy_blocks:
            for offset in range(bs):
                if src * bs + offset in self.pool:
                    self.pool[dst * bs + offset] = self.pool[src * bs + offset]
        out = []
        for seq in seqs:
            n = len(seq.token_ids)
            mask = seq.attn_mask if seq.attn_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
            for i, (token, slot) in enumerate(zip(seq.token_ids, seq.slot_mapping, strict=True)):
                assert slot == self._slot(seq.block_table, seq.past_len + i), "slot mapping disagrees with the table"
                self.pool[slot] = token
            if seq.positions is not None:  # a tree: a node's position is the root's plus its depth
                assert all(seq.positions[i] == seq.past_len + int(mask[i].sum()) - 1 for i in range(n)), "positions"
            rows = {"all": n, "last": 1, "none": 0}[seq.logits] if isinstance(seq.logits, str) else seq.logits
            logits = torch.full((rows, FAKE_VOCAB), -10.0)
            for row, i in enumerate(range(n - rows, n)):
                slots = [self._slot(seq.block_table, p) for p in range(seq.past_len)]
                slots += [seq.slot_mapping[j] for j in range(n) if mask[i, j]]
                missing = [s for s in slots if s not in self.pool]
                assert not missing, f"slots {missing} were never written"
                choice = self.rule([self.pool[s] for s in slots])  # a token, or tokens best first
                for rank, token in enumerate([choice] if isinstance(choice, int) else choice):
                    logits[row, token] = 10.0 - rank
            out.append(logits)
        return out


def fake_engine(num_blocks: int = 256, block_size: int = 4, max_batch: int = 4, overlap: bool = False,
                k_max: int = 4, predraft: bool = False,
                draft_rule: Callable[[list[int]], int | list[int]] = fake_draft_token, observer: Any = None,
                target_rule: Callable[[list[int]], int] = fake_next_token, tree_nodes: int = 16,
                model_tree_nodes: int = 0, reservation_windows: bool = True,
                draft_stop_below: float = 0.5, draft_lookup: bool = True, exact_rule: str = "block",
                cost: CostModel | None = None) -> SpecEngine:
    """The real engine, ledger (in process) and workers over FakeRunners, with a draft model (drafting by
    `draft_rule`); no EOS."""
    config = engine_config(max_batch=max_batch, queue_capacity=64, max_context=1024, k_max=k_max, overlap=overlap,
                           predraft=predraft, tree_nodes=tree_nodes, model_tree_nodes=model_tree_nodes,
                           reservation_windows=reservation_windows, draft_stop_below=draft_stop_below,
                           draft_lookup=draft_lookup, exact_rule=exact_rule)
    namespaces = [NamespaceConfig(TARGET_NAMESPACE, num_blocks, block_size),
                  NamespaceConfig(DRAFT_NAMESPACE, num_blocks, block_size)]
    return SpecEngine(VerifierWorker(FakeRunner(target_rule, block_size)),
                      DraftWorker(FakeRunner(draft_rule, block_size)), LocalKV(BlockLedger(namespaces)),
                      tokenizer=None, eos_token_ids=(), vocab_size=FAKE_VOCAB, config=config,
                      model_name="fake", draft_name="fake-draft", observer=observer, cost=cost)


def prepared_model(name: str) -> Path:
    """A bundled model's prepared checkpoint, or the test skipped and saying how to prepare it (`make setup`
    prepares SmolLM2 only)."""
    source = resolve_model(name)
    path = source if isinstance(source, Path) else cached_path(source)
    if path is None:
        pytest.skip(f"{name} is not prepared on this machine (`specserve models prepare {name}`)")
    return path
