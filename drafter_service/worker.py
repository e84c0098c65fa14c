"""DraftWorker: runs the draft model autoregressively for k steps per request, batched across the
round's requests, and returns the draft tokens with their transformed probabilities q. A greedy chain with
`stop_below` ends after a draft the model gives less than that probability (1..k drafts); a greedy tree with it
feeds no level whose best path the model gives less (1..k levels; draft_tree.py).
Owner of the draft model's KV pool (draft namespace; its blocks are granted by the KV manager).

Draft cache after a round with k drafts x_1..x_k: the catch-up tokens and x_1..x_{k-1} have KV;
x_k's KV is never written (no step consumes it), so the caller reserves len(input_ids) + k - 1 slots.
A tree item (`tree_nodes` > 0) grows a token tree instead (draft_tree.py), in the same forwards as the chains.
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np
import torch

from drafter_service.draft_constraints import DraftConstraints
from drafter_service.draft_tree import DraftTree
from model_runtime.batch import SeqInput
from specserve_types.round_messages import ProposeBatch, ProposeItem, ProposeOutput, ProposeResult
from verifier_service.sampling import (
    allowed_ids,
    apply_allowed,
    apply_logit_bias,
    argmax_rows,
    greedy_allowed,
    penalized_logits_for_positions,
    sample_on_support,
    sample_token,
    transform_logits,
)
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
    def __init__(self, runner: ForwardRunner, constraints: DraftConstraints | None = None) -> None:
        """`constraints`: the matchers of constrained requests' chains (drafter_service/draft_constraints.py);
        None: every chain is drafted freely (the engine cuts what a constraint forbids)."""
        self.runner = runner
        self.config = runner.config
        self.instance = uuid.uuid4().hex  # a new process means a new, empty KV pool
        self.constraints = constraints

    def propose(self, batch: ProposeBatch) -> ProposeResult:
        start = time.perf_counter()
        drafts: dict[str, list[int]] = {item.request_id: [] for item in batch.items}
        probs: dict[str, list[torch.Tensor]] = {item.request_id: [] for item in batch.items}
        trees = {item.request_id: DraftTree(item) for item in batch.items if item.tree_nodes}
        # constrained chains: each request's matcher at its committed output, moved along its own drafts below and
        # rolled back after the loop
        matchers = {} if self.constraints is None else self.constraints.matchers(
            [item for item in batch.items if item.constraint is not None and not item.tree_nodes])
        frontiers: dict[str, list[int]] = {}
        stopped: set[str] = set()  # greedy chains and trees that ended early (item.stop_below)
        copies = [pair for item in batch.items for pair in item.copy_blocks]
        for step in range(max((item.k for item in batch.items), default=0)):
            active, inputs = [], []
            for item in batch.items:
                tree = trees.get(item.request_id)
                if item.k <= step or item.request_id in stopped:
                    continue
                if tree is None or step == 0:
                    inputs.append(_step_input(item, drafts[item.request_id]))
                else:  # level step + 1 of its tree: the best nodes of level `step` are fed
                    frontiers[item.request_id] = tree.frontier(step)
                    if not frontiers[item.request_id]:
                        continue
                    if not tree.sure_enough(frontiers[item.request_id]):
                        stopped.add(item.request_id)  # its deeper levels would rarely be accepted
                        continue
                    inputs.append(tree.step_input(frontiers[item.request_id]))
                active.append(item)
            if not inputs:  # every chain done (stopped early) and every tree out of frontier: no more steps
                break
            logits_list = self.runner.forward(inputs, copies)
            copies = []
            for item, logits in zip(active, logits_list, strict=True):
                logits = apply_logit_bias(logits, item.sampling.logit_bias)  # q as p's processors make it
                if item.request_id in trees:
                    q = torch.softmax(logits.float(), -1) if item.sampling.is_greedy else transform_logits(
                        logits, item.sampling)
                    parents = [-1] if step == 0 else frontiers[item.request_id]
                    for parent, row in zip(parents, q, strict=True):
                        trees[item.request_id].add_children(parent, row)
                    continue
                mine = drafts[item.request_id]
                if item.sampling.has_penalties:
                    logits = penalized_logits_for_positions(logits, item.prompt_ids, item.output_ids + mine, [],
                                                            item.sampling)
                matcher = matchers.get(item.request_id)
                greedy = item.sampling.is_greedy
                mask = None if matcher is None else matcher.allowed_mask()
                if mask is not None and not mask.any():
                    mask = None
                narrow = None if mask is None or greedy else allowed_ids(mask, logits.shape[-1])
                # keyed by the round too: a block verdict depends on every draft of the round, so a later round's
                # draft at the same position must not reuse its uniform (sampling.request_generator)
                if narrow is not None:  # a sampled chain on the few tokens its constraint allows: q on those columns
                    token, q = sample_on_support(logits[0], narrow, item.sampling, item.seed, item.position + step,
                                                 "draft", round_start=item.position)
                else:
                    if mask is not None:  # q as the target's p: masked along the chain's own drafts
                        rows = mask[None]  # a greedy chain reads the argmax alone (sampling.greedy_allowed)
                        logits = greedy_allowed(logits, rows) if greedy and not item.want_probs else \
                            apply_allowed(logits, rows)
                    q = transform_logits(logits, item.sampling)[0] if item.want_probs or not greedy else None
                    if greedy:  # transform_logits' one-hot sits at the argmax: the token without building it
                        row = logits[0].float()
                        token = int(argmax_rows(row))
                        if item.stop_below > 0 and float(torch.exp(row[token] - row.logsumexp(-1))) < item.stop_below:
                            stopped.add(item.request_id)  # its next drafts would rarely survive
                    else:
                        token = sample_token(q, item.seed, item.position + step, "draft", round_start=item.position)
                mine.append(token)
                if matcher is not None and not matcher.step(token):
                    matchers.pop(item.request_id)  # a token it forbids (none allowed): the rest drafts freely
                if q is not None and item.want_probs:
                    probs[item.request_id].append(q)
        for matcher in matchers.values():
            matcher.rewind()  # back to the committed output: the drafts are the verifier's to judge
        outputs = []
        for item in batch.items:
            if item.request_id in trees:
                tokens, parents = trees[item.request_id].result()
                outputs.append(ProposeOutput(item.request_id, tokens, None, parents))
                continue
            outputs.append(ProposeOutput(
                request_id=item.request_id, draft_ids=drafts[item.request_id],
                draft_probs=torch.stack(probs[item.request_id]).numpy().astype(np.float32)
                if item.want_probs and probs[item.request_id] else None,
            ))
        return ProposeResult(outputs=outputs, seconds=time.perf_counter() - start, worker_instance=self.instance)
