"""The messages of one speculative round between the scheduler and its workers.

Plain picklable dataclasses; probabilities travel as float32 numpy arrays (pickled torch tensors
are several times slower across processes). One propose call and one verify call per round
carry the whole batch.

    scheduler --ProposeBatch--> drafter   --ProposeResult-->  scheduler
    scheduler --VerifyBatch-->  verifier  --VerifyResult-->   scheduler

Glossary:
  input_ids   tokens whose KV the worker's cache does not hold yet (the catch-up tokens: usually
              the previous round's correction or bonus token; the whole uncached prompt at prefill)
  past_len    how many tokens of the sequence the worker's cache already holds (committed)
  position    index in the full sequence (prompt + output) of the first token this round decides
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specserve_types.api import Constraint, RowLogprobs, SamplingParams


@dataclass
class ProposeItem:
    request_id: str
    input_ids: list[int]
    past_len: int
    block_table: list[int]
    slot_mapping: list[int]  # len(input_ids) + k - 1 slots: the last draft's KV is never written
    k: int
    sampling: SamplingParams
    seed: int
    position: int
    want_probs: bool
    prompt_ids: list[int] = field(default_factory=list)  # only when penalties are active
    output_ids: list[int] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write before writing
    # a token tree instead of a chain (drafter_service/draft_tree.py): at most tree_nodes nodes over k levels,
    # the tree_width likeliest nodes of each level expanded; slot_mapping then holds len(input_ids) +
    # tree_width * (k - 1) scratch slots. 0: a chain.
    tree_nodes: int = 0
    tree_width: int = 0
    # a greedy chain stops after a draft whose probability under the draft model is below this (0: drafts k)
    stop_below: float = 0.0
    # a chain drafted under the request's constraint (q masked along its own drafts; output_ids then hold the committed
    # output, which the drafter's matcher for the request catches up with); None: drafted freely
    constraint: Constraint | None = None


@dataclass
class ProposeBatch:
    items: list[ProposeItem]
    trace_context: tuple[tuple[str, str], ...] = ()  # W3C carrier of the round span it serves (tracing.py)


@dataclass
class ProposeOutput:
    request_id: str
    draft_ids: list[int]
    draft_probs: np.ndarray | None  # [k, V] float32: q after the request's sampling transform
    draft_parents: list[int] | None = None  # a tree's (tree_nodes > 0): draft i's parent, -1 = the root


@dataclass
class ProposeResult:
    outputs: list[ProposeOutput]
    seconds: float
    worker_instance: str = ""  # changes when the worker process (and its KV pool) is replaced


@dataclass
class VerifyItem:
    request_id: str
    input_ids: list[int]
    draft_ids: list[int]
    draft_probs: np.ndarray | None  # None: point-mass drafter (n-gram) or greedy
    past_len: int
    block_table: list[int]
    slot_mapping: list[int]  # len(input_ids) + len(draft_ids) slots
    sampling: SamplingParams
    contract: str
    seed: int
    position: int
    prompt_ids: list[int] = field(default_factory=list)  # only when penalties are active
    output_ids: list[int] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    # a token tree's drafts (verifier_service/tree_contracts.py): draft i's parent draft, -1 = the last input
    # token; None = a chain. The worker keeps the accepted path's KV in the first slots after the inputs.
    draft_parents: list[int] | None = None
    # the exact contract's rule for a sampled chain (verifier_service/contracts.py EXACT_RULES): "block" (block
    # verification) or "token" (token by token); the engine's `exact_rule`
    exact_rule: str = "token"
    # the request's constraint (verifier_service/constraint.py): each scored row's allowed tokens along its own prefix,
    # int32 bitmask words [rows, ceil(V / 32)] (bit i of word w allows token 32 w + i); None: unconstrained
    allowed: np.ndarray | None = None
    # score the prompt (sampling.prompt_logprobs set, the request's first round): input_ids are the whole prompt from
    # position 0 (past_len 0), and every input row is scored, not only the last
    score_prompt: bool = False


@dataclass
class VerifyBatch:
    items: list[VerifyItem]
    trace_context: tuple[tuple[str, str], ...] = ()  # W3C carrier of the round span it serves (tracing.py)


@dataclass
class VerifyOutput:
    request_id: str
    accepted_len: int  # draft tokens accepted
    tokens: list[int]  # accepted drafts + the correction or bonus token
    bonus: bool
    accepted_path: list[int] | None = None  # a tree's accepted drafts (indices into draft_ids), root first
    logprobs: RowLogprobs | None = None  # `tokens`' log-probabilities (sampling.logprobs set), one row each
    prompt_logprobs: RowLogprobs | None = None  # the item's prompt's (score_prompt): rows for input tokens 1..


@dataclass
class VerifyResult:
    outputs: list[VerifyOutput]
    seconds: float
    scored_tokens: int  # new tokens scored in the forward (for the cost model)
    worker_instance: str = ""  # changes when the worker process (and its KV pool) is replaced
