"""VerifierWorker: scores a whole round's batch in one forward of the target model and applies each
request's acceptance contract. Owner of the target model's KV pool (through its runner).

The runner is rank 0 of the tensor-parallel group (`model_runtime.tp.TPRank` for TP=1, or a driver
that fans the same batch out to every TP rank actor).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Protocol

import torch

from model_runtime.batch import SeqInput
from model_runtime.config import ModelConfig
from model_runtime.graph.modes import CapturePlan
from specserve_types.api import RowLogprobs
from specserve_types.round_messages import VerifyBatch, VerifyItem, VerifyOutput, VerifyResult
from verifier_service.contracts import Verdict, verify_exact, verify_greedy, verify_typical
from verifier_service.logprobs import processed_rows, prompt_logprobs, row_logprobs
from verifier_service.sampling import (
    allowed_ids,
    allows_columns,
    apply_allowed,
    apply_logit_bias,
    greedy_allowed,
    penalized_logits_for_positions,
    transform_logits,
)
from verifier_service.tree_contracts import TokenTree, TreeVerdict, tree_greedy, verify_tree

log = logging.getLogger("specserve.verifier")


class ForwardRunner(Protocol):
    config: ModelConfig

    def forward(self, seqs: list[SeqInput], copy_blocks: list[tuple[int, int]],
                slot_moves: tuple[tuple[int, int], ...] = ()) -> list[torch.Tensor]:
        """Move `slot_moves` (the last round's accepted tree paths), copy `copy_blocks`, then run `seqs`."""
        ...


class LocalRunner:
    """TP=1 in this process: the model and its pool (owner of both). `capture`: the steps through captured
    programs (model_runtime/graph/: `CaptureSettings.plan`), made here, at the worker's start-up; None: the eager
    forward."""

    def __init__(self, checkpoint_dir: str, num_blocks: int, block_size: int, device: str = "cpu",
                 dtype: torch.dtype | None = None, capture: CapturePlan | None = None) -> None:
        from model_runtime.tp import TPRank

        self.rank = TPRank(checkpoint_dir, 0, 1, num_blocks, block_size, device, dtype, capture)
        self.config = self.rank.model.config

    def forward(self, seqs: list[SeqInput], copy_blocks: list[tuple[int, int]],
                slot_moves: tuple[tuple[int, int], ...] = ()) -> list[torch.Tensor]:
        self.rank.kv.move_slots(list(slot_moves))
        self.rank.kv.copy_blocks(copy_blocks)
        return self.rank.forward(seqs)

    def warm_up(self, block_size: int) -> None:
        """A short prefill and one decode step into block 0, before the worker answers anything: a replica's first
        round then runs at speed (its kernels, thread team and allocator already warm), not past the caller's
        timeout. Block 0's slots hold nothing yet in a new process, and no grant reads a slot before writing it."""
        n = max(1, min(4, block_size - 1))
        self.forward([SeqInput([0] * n, 0, [0], list(range(n)), logits="last")], [])
        if n < block_size:
            self.forward([SeqInput([0], n, [0], [n], logits="last")], [])


def processed_logits(item: VerifyItem, logits: torch.Tensor, greedy: bool = False,
                     columns: torch.Tensor | None = None) -> torch.Tensor:
    """The request's logits processors on its scored rows, in one order for plain decoding and every speculative
    path: logit bias, penalties (each row its own history), the constraint's mask (each row its own prefix's).
    `greedy`: only each row's argmax is read, so only rows whose argmax the constraint forbids are masked.
    `columns`: those token ids only (ascending; every token the mask allows in some row among them), [n, len]."""
    params = item.sampling
    logits = apply_logit_bias(logits, params.logit_bias)
    if params.has_penalties:
        logits = penalized_logits_for_positions(logits, item.prompt_ids, item.output_ids, item.draft_ids, params)
    if columns is not None:
        assert item.allowed is not None, "columns come from the constraint's mask"
        logits = logits[:, columns]
        return logits.masked_fill(~allows_columns(item.allowed[:logits.shape[0]], columns), float("-inf"))
    if item.allowed is not None:
        allowed = item.allowed[:logits.shape[0]]
        logits = greedy_allowed(logits, allowed) if greedy else apply_allowed(logits, allowed)
    return logits


def decide(item: VerifyItem, logits: torch.Tensor, inject_bias: bool = False) -> Verdict:
    """Apply the request's logits processors, transform and contract to its k+1 scored rows. `inject_bias`: see
    `VerifierWorker.inject_bias` (testing the check only)."""
    k = len(item.draft_ids)
    params = item.sampling
    first_draft_position = item.past_len + len(item.input_ids)
    if item.contract == "greedy" or params.is_greedy:
        verdict = verify_greedy(item.draft_ids, processed_logits(item, logits, greedy=True))
        return verdict if item.contract == "greedy" else Verdict(
            verdict.accepted_len, verdict.next_token, verdict.tokens, item.contract, verdict.bonus, k)
    q = None if item.draft_probs is None else torch.from_numpy(item.draft_probs)
    support = None if item.allowed is None or item.contract != "exact" else \
        allowed_ids(item.allowed[:logits.shape[0]], logits.shape[-1], also=item.draft_ids)
    if support is not None:  # the round on the columns its constraint allows in any row (and the drafts)
        p = transform_logits(processed_logits(item, logits, columns=support), params)
        return verify_exact(item.draft_ids, q, p, item.seed, first_draft_position, inject_bias, item.exact_rule,
                            support=support)
    p = transform_logits(processed_logits(item, logits), params)
    if item.contract == "typical":
        return verify_typical(item.draft_ids, p, item.seed, first_draft_position)
    return verify_exact(item.draft_ids, q, p, item.seed, first_draft_position, inject_bias, item.exact_rule)


def emitted_logprobs(item: VerifyItem, logits: torch.Tensor, rows: list[int], tokens: list[int]
                     ) -> RowLogprobs | None:
    """The emitted tokens' log-probabilities (verifier_service/logprobs.py), from the rows that decided them (`rows`
    of the item's decided logits); None where the request asks for none."""
    params = item.sampling
    if params.logprobs is None:
        return None
    if params.logprobs_mode == "raw":
        return row_logprobs(logits[rows], tokens, params.logprobs)
    processed = processed_logits(item, logits)  # every processor, the constraint's mask on every row
    return row_logprobs(processed_rows(processed, params)[rows], tokens, params.logprobs)


def tree_of(item: VerifyItem) -> TokenTree:
    assert item.draft_parents is not None, "a chain item"
    if not item.input_ids:
        raise ValueError(f"{item.request_id}: a tree needs its root token among the inputs")
    if item.draft_probs is not None or item.sampling.has_penalties:
        raise ValueError(f"{item.request_id}: trees take deterministic candidates without penalties")
    return TokenTree(tuple(item.draft_ids), tuple(item.draft_parents))


def seq_input(item: VerifyItem, tree: TokenTree | None) -> SeqInput:
    """The item's forward input: its inputs then its drafts, causal for a chain; for a tree (`tree_of(item)`), the
    inputs causal and each node after every input and its own ancestors, at position (the root's) + its depth."""
    tokens = item.input_ids + item.draft_ids
    rows: str | int = "all" if item.score_prompt else len(item.draft_ids) + 1
    if tree is None:
        return SeqInput(token_ids=tokens, past_len=item.past_len, block_table=item.block_table,
                        slot_mapping=item.slot_mapping, logits=rows)
    inputs = len(item.input_ids)
    mask = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
    mask[inputs:, inputs:] = tree.ancestor_mask()
    root = item.past_len + inputs - 1
    positions = list(range(item.past_len, root + 1)) + [root + d for d in tree.depths()]
    return SeqInput(token_ids=tokens, past_len=item.past_len, block_table=item.block_table,
                    slot_mapping=item.slot_mapping, positions=positions, attn_mask=mask, logits=rows)


def decide_tree(item: VerifyItem, tree: TokenTree, logits: torch.Tensor, inject_bias: bool = False) -> TreeVerdict:
    """A tree's contract on its root's and nodes' rows (greedy sampling under any contract follows the argmax)."""
    params = item.sampling
    logits = processed_logits(item, logits, greedy=item.contract == "greedy" or params.is_greedy)  # no penalties
    if item.contract == "greedy" or params.is_greedy:
        verdict = tree_greedy(tree, logits)
        return dataclasses.replace(verdict, contract=item.contract)
    position = item.past_len + len(item.input_ids)
    return verify_tree(tree, transform_logits(logits, params), item.contract, item.seed, position,
                       inject_bias=inject_bias)


def path_moves(item: VerifyItem, path: tuple[int, ...]) -> list[tuple[int, int]]:
    """(src, dst) slots that bring the accepted nodes' KV to the first draft slots, in path order."""
    first = len(item.input_ids)
    return [(item.slot_mapping[first + node], item.slot_mapping[first + j]) for j, node in enumerate(path)
            if node != j]


class VerifierWorker:
    def __init__(self, runner: ForwardRunner, inject_bias: bool = False) -> None:
        self.runner = runner
        self.config = runner.config
        self.instance = uuid.uuid4().hex  # a new process means a new, empty KV pool
        # For testing the statistical check only (`specserve check exact --inject-bias`, in process): the exact
        # contract then resamples from p instead of the residual after a rejection, which is WRONG on purpose.
        self.inject_bias = inject_bias
        # the accepted tree paths' KV compaction, run at the start of the next forward (before anything reads the
        # pool: a request's next round, a fork's copy, a prefix hit); written only by `verify`
        self._slot_moves: tuple[tuple[int, int], ...] = ()

    def verify(self, batch: VerifyBatch, on_sent: Callable[[], None] | None = None) -> VerifyResult:
        if on_sent is not None:  # in process: the caller's hook runs first (cluster/engine/backends.py)
            on_sent()
        start = time.perf_counter()
        trees = [None if item.draft_parents is None else tree_of(item) for item in batch.items]
        seqs = [seq_input(item, tree) for item, tree in zip(batch.items, trees, strict=True)]
        copies = [pair for item in batch.items for pair in item.copy_blocks]
        if not seqs:
            return VerifyResult(outputs=[], seconds=time.perf_counter() - start, scored_tokens=0,
                                worker_instance=self.instance)
        # taken before the call: a failed verify requeues every request (it re-prefills), and a repeated move
        # could read a slot the failed forward overwrote
        moves_due, self._slot_moves = self._slot_moves, ()
        all_logits = self.runner.forward(seqs, copies, moves_due)
        outputs, moves = [], []
        for item, tree, rows in zip(batch.items, trees, all_logits, strict=True):
            logits = rows[len(item.input_ids) - 1:] if item.score_prompt else rows  # the decided rows
            prompt = prompt_logprobs(rows, item.input_ids, item.sampling.prompt_logprobs or 0) \
                if item.score_prompt else None
            if tree is None:
                verdict = decide(item, logits, self.inject_bias)
                emitted = list(range(len(verdict.tokens)))
                outputs.append(VerifyOutput(item.request_id, verdict.accepted_len, verdict.tokens, verdict.bonus,
                                            logprobs=emitted_logprobs(item, logits, emitted, verdict.tokens),
                                            prompt_logprobs=prompt))
                continue
            tree_verdict = decide_tree(item, tree, logits, self.inject_bias)
            leaf = not tree.children(tree_verdict.path[-1] if tree_verdict.path else -1)
            emitted = [0, *(node + 1 for node in tree_verdict.path)]
            outputs.append(VerifyOutput(item.request_id, tree_verdict.accepted_len, list(tree_verdict.tokens), leaf,
                                        accepted_path=list(tree_verdict.path),
                                        logprobs=emitted_logprobs(item, logits, emitted, list(tree_verdict.tokens)),
                                        prompt_logprobs=prompt))
            moves += path_moves(item, tree_verdict.path)
        self._slot_moves = tuple(moves)
        scored = sum(len(s.token_ids) for s in seqs)
        return VerifyResult(outputs=outputs, seconds=time.perf_counter() - start, scored_tokens=scored,
                            worker_instance=self.instance)
