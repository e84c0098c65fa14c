"""Greedy decoding of one prompt through captured runners with a local allocator (no ledger): plain, one token a
step, and speculative, a draft's chain of k then the target's verdict. The tests' and the GPU check's loops
(tests/model_runtime/graph/test_runner.py, scripts/gpu_captured_steps.py); the engine runs rounds its own way.

Rollback moves a length (the rejected rows' slots are written again next round):

    target  cached += len(pending) + accepted           (the next token gets its KV next round)
    draft   cached += len(draft pending) + min(accepted, k - 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from model_runtime.batch import SeqInput
from model_runtime.graph.runner import CapturedRunner
from model_runtime.local_alloc import LocalAllocator, LocalSequence

Forward = Callable[[list[SeqInput]], list[torch.Tensor]]


def chain_step(alloc: LocalAllocator, seqs: list[LocalSequence], tokens: list[list[int]], chain: int
               ) -> tuple[list[SeqInput], list[list[int]]]:
    """A draft chain's catch-up rows (`tokens[i]` for seq i) and its chain - 1 later slots, the table's next ones
    (the catch-up's SeqInput carries the table that holds them)."""
    catch_up = [alloc.extend(seq, list(t)) for seq, t in zip(seqs, tokens, strict=True)]
    slots = [alloc.extend(seq, [0] * (chain - 1)).slot_mapping for seq in seqs]
    return ([dataclasses.replace(s, block_table=list(seq.block_table)) for s, seq in zip(catch_up, seqs, strict=True)],
            slots)


def _all_back(alloc: LocalAllocator, seq: LocalSequence, num_blocks: int) -> None:
    alloc.free(seq)
    assert sorted(alloc.free_blocks) == list(range(num_blocks)), "a block leaked"


def plain_greedy(forward: Forward, prompt: list[int], new_tokens: int, num_blocks: int, block_size: int
                 ) -> list[int]:
    """`new_tokens` greedy tokens, one forward each (`forward`: a runner's forward_seqs, or the eager model's on
    its own pool)."""
    alloc, seq = LocalAllocator(num_blocks, block_size), LocalSequence()
    step = alloc.extend(seq, prompt, "last")
    out: list[int] = []
    while len(out) < new_tokens:
        (logits,) = forward([step])
        out.append(int(logits[-1].argmax()))
        step = alloc.extend(seq, [out[-1]], "last")
    _all_back(alloc, seq, num_blocks)
    return out


def speculative_greedy(target: CapturedRunner, draft: CapturedRunner, prompt: list[int], new_tokens: int,
                       num_blocks: int) -> tuple[list[int], list[int]]:
    """(`new_tokens` greedy tokens, accepted drafts per round): draft.chain drafts a round."""
    k, block_size = draft.chain, target.block_size
    t_alloc, d_alloc = LocalAllocator(num_blocks, block_size), LocalAllocator(num_blocks, draft.block_size)
    t_seq, d_seq = LocalSequence(), LocalSequence()
    (logits,) = target.forward_seqs([t_alloc.extend(t_seq, prompt, "last")])  # prefill: the eager forward
    draft.forward_seqs([d_alloc.extend(d_seq, prompt, "none")])
    tokens, accepted = [*prompt, int(logits[-1].argmax())], []
    while len(tokens) - len(prompt) < new_tokens:
        t_cached, d_cached = t_seq.length, d_seq.length
        d_pending, pending = tokens[d_cached:], tokens[t_cached:]
        catch_up, slots = chain_step(d_alloc, [d_seq], [d_pending], k)
        (drafted,) = draft.draft_greedy(catch_up, slots)
        (verdict,) = target.verify_greedy([t_alloc.extend(t_seq, pending + drafted)], [k])
        tokens += [*drafted[:verdict.accepted], verdict.next_token]
        accepted.append(verdict.accepted)
        t_seq.length = t_cached + len(pending) + verdict.accepted
        d_seq.length = d_cached + len(d_pending) + min(verdict.accepted, k - 1)
    _all_back(t_alloc, t_seq, num_blocks)
    _all_back(d_alloc, d_seq, num_blocks)
    return tokens[len(prompt):len(prompt) + new_tokens], accepted
