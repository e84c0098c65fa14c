"""VerifierWorker: scores a whole round's batch in one forward of the target model and applies each
request's acceptance contract. Owner of the target model's KV pool (through its runner).

The runner is rank 0 of the tensor-parallel group (`model_runtime.tp.TPRank` for TP=1, or a driver
that fans the same batch out to every TP rank actor).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Protocol

import torch

from model_runtime.batch import SeqInput
from model_runtime.config import ModelConfig
from specserve_types.round_messages import VerifyBatch, VerifyItem, VerifyOutput, VerifyResult
from verifier_service.contracts import Verdict, verify_exact, verify_greedy, verify_typical
from verifier_service.sampling import penalized_logits_for_positions, transform_logits

log = logging.getLogger("specserve.verifier")


class ForwardRunner(Protocol):
    config: ModelConfig

    def forward(self, seqs: list[SeqInput], copy_blocks: list[tuple[int, int]]) -> list[torch.Tensor]: ...


class LocalRunner:
    """TP=1 in this process: the model and its pool (owner of both)."""

    def __init__(self, checkpoint_dir: str, num_blocks: int, block_size: int, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        from model_runtime.tp import TPRank

        self.rank = TPRank(checkpoint_dir, 0, 1, num_blocks, block_size, device, dtype)
        self.config = self.rank.model.config

    def forward(self, seqs: list[SeqInput], copy_blocks: list[tuple[int, int]]) -> list[torch.Tensor]:
        self.rank.kv.copy_blocks(copy_blocks)
        return self.rank.forward(seqs)


def decide(item: VerifyItem, logits: torch.Tensor, inject_bias: bool = False) -> Verdict:
    """Apply the request's penalties, transform and contract to its k+1 scored rows. `inject_bias`: see
    `VerifierWorker.inject_bias` (testing the check only)."""
    k = len(item.draft_ids)
    params = item.sampling
    if params.has_penalties:
        logits = penalized_logits_for_positions(logits, item.prompt_ids, item.output_ids, item.draft_ids, params)
    first_draft_position = item.past_len + len(item.input_ids)
    if item.contract == "greedy" or params.is_greedy:
        verdict = verify_greedy(item.draft_ids, logits)
        return verdict if item.contract == "greedy" else Verdict(
            verdict.accepted_len, verdict.next_token, verdict.tokens, item.contract, verdict.bonus, k)
    p = transform_logits(logits, params)
    if item.contract == "typical":
        return verify_typical(item.draft_ids, p, item.seed, first_draft_position)
    q = None if item.draft_probs is None else torch.from_numpy(item.draft_probs)
    return verify_exact(item.draft_ids, q, p, item.seed, first_draft_position, inject_bias)


class VerifierWorker:
    def __init__(self, runner: ForwardRunner, inject_bias: bool = False) -> None:
        self.runner = runner
        self.config = runner.config
        self.instance = uuid.uuid4().hex  # a new process means a new, empty KV pool
        # For testing the statistical check only (`specserve check exact --inject-bias`, in process): the exact
        # contract then resamples from p instead of the residual after a rejection, which is WRONG on purpose.
        self.inject_bias = inject_bias

    def verify(self, batch: VerifyBatch) -> VerifyResult:
        start = time.perf_counter()
        seqs = [
            SeqInput(token_ids=item.input_ids + item.draft_ids, past_len=item.past_len, block_table=item.block_table,
                     slot_mapping=item.slot_mapping, logits=len(item.draft_ids) + 1)
            for item in batch.items
        ]
        copies = [pair for item in batch.items for pair in item.copy_blocks]
        all_logits = self.runner.forward(seqs, copies) if seqs else []
        outputs = []
        for item, logits in zip(batch.items, all_logits, strict=True):
            verdict = decide(item, logits, self.inject_bias)
            outputs.append(VerifyOutput(item.request_id, verdict.accepted_len, verdict.tokens, verdict.bonus))
        scored = sum(len(s.token_ids) for s in seqs)
        return VerifyResult(outputs=outputs, seconds=time.perf_counter() - start, scored_tokens=scored,
                            worker_instance=self.instance)
