"""DraftWorker: runs the draft model autoregressively for k steps per request, batched across the
round's requests, and returns the draft tokens with their transformed probabilities q.
Owner of the draft model's KV pool (draft namespace; its blocks are granted by the KV manager).

Draft cache after a round with k drafts x_1..x_k: the catch-up tokens and x_1..x_{k-1} have KV;
x_k's KV is never written (no step consumes it), so the caller reserves len(input_ids) + k - 1 slots.
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np
import torch

from model_runtime.batch import SeqInput
from specserve_types.round_messages import ProposeBatch, ProposeItem, ProposeOutput, ProposeResult
from verifier_service.sampling import penalized_logits_for_positions, sample_token, transform_logits
from verifier_service.worker import ForwardRunner

log = logging.getLogger("specserve.drafter")


def _step_input(item: ProposeItem, drafts: list[int]) -> SeqInput:
    """Step s = len(drafts): step 0 feeds the catch-up tokens, step s > 0 feeds draft x_s."""
    n_in = len(item.input_ids)
    if not drafts:
        return SeqInput(token_ids=item.input_ids, past_len=item.past_len, block_table=item.block_table,
                        slot_mapping=item.slot_mapping[:n_in], logits=1)
    s = len(drafts)
    return SeqInput(token_ids=[drafts[-1]], past_len=item.past_len + n_in + s - 1, block_table=item.block_table,
                    slot_mapping=item.slot_mapping[n_in + s - 1:n_in + s], logits=1)


class DraftWorker:
    def __init__(self, runner: ForwardRunner) -> None:
        self.runner = runner
        self.config = runner.config
        self.instance = uuid.uuid4().hex  # a new process means a new, empty KV pool

    def propose(self, batch: ProposeBatch) -> ProposeResult:
        start = time.perf_counter()
        drafts: dict[str, list[int]] = {item.request_id: [] for item in batch.items}
        probs: dict[str, list[torch.Tensor]] = {item.request_id: [] for item in batch.items}
        copies = [pair for item in batch.items for pair in item.copy_blocks]
        for step in range(max((item.k for item in batch.items), default=0)):
            active = [item for item in batch.items if item.k > step]
            logits_list = self.runner.forward([_step_input(i, drafts[i.request_id]) for i in active], copies)
            copies = []
            for item, logits in zip(active, logits_list, strict=True):
                mine = drafts[item.request_id]
                if item.sampling.has_penalties:
                    logits = penalized_logits_for_positions(logits, item.prompt_ids, item.output_ids + mine, [],
                                                            item.sampling)
                q = transform_logits(logits, item.sampling)[0]
                if item.sampling.is_greedy:
                    token = int(q.argmax())
                else:
                    token = sample_token(q, item.seed, item.position + step, "draft")
                mine.append(token)
                if item.want_probs:
                    probs[item.request_id].append(q)
        outputs = [
            ProposeOutput(
                request_id=item.request_id, draft_ids=drafts[item.request_id],
                draft_probs=torch.stack(probs[item.request_id]).numpy().astype(np.float32)
                if item.want_probs and probs[item.request_id] else None,
            )
            for item in batch.items
        ]
        return ProposeResult(outputs=outputs, seconds=time.perf_counter() - start, worker_instance=self.instance)
