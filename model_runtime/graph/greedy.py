"""Greedy decisions in tensor form on the device, inside the captured step (no round trip between the forward and
the verdict; the host reads only the result).

A verified chain, one sequence's rows (f = first_row, k = drafts):

    rows     ... f       f+1     f+2   ...  f+k
    input        x       d_1     d_2        d_k        (x: the last pending token; d_i the drafts)
    argmax       g_0     g_1     g_2        g_k
    accepted = the longest i with g_0 == d_1, ..., g_{i-1} == d_i;  next token = g_accepted (correction or bonus)

A draft's greedy chain of S steps: its catch-up rows in one forward, then S - 1 one-row forwards, each fed the
previous argmax, in the same program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from model_runtime.graph.staging import StepInputs


def greedy_verdict(logits: torch.Tensor, x: StepInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, R, V] -> (argmax [B, R], accepted drafts [B], next token [B]) for the chains of `x`
    (first_row, drafts); a sequence with no drafts: accepted 0, next token its last row's argmax."""
    argmax = logits.argmax(dim=-1)
    rows = argmax.shape[1]
    i = torch.arange(rows - 1, device=argmax.device)
    answering = (x.first_row[:, None] + i).clamp(max=rows - 1)
    drafted = (answering + 1).clamp(max=rows - 1)
    match = (argmax.gather(1, answering) == x.token_ids.gather(1, drafted)) & (i < x.drafts[:, None])
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    next_token = argmax.gather(1, (x.first_row + accepted)[:, None]).squeeze(1)
    return argmax, accepted, next_token


Forward = Callable[[StepInputs], torch.Tensor]


def greedy_chain(forward: Forward, x: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft's S = chain_slots.shape[1] + 1 greedy steps: (tokens [B, S], logits [B, S, V]). The first step is
    x's rows (the catch-up; its last real row, first_row, gives token 1), each later step one row at the next
    position, written to the next chain slot, reading every earlier row through the table."""
    batch = x.token_ids.shape[0]
    steps = x.chain_slots.shape[1] + 1
    logits = forward(x)
    vocab = logits.shape[-1]
    last = x.first_row + x.drafts
    row_logits = [logits.gather(1, last[:, None, None].expand(batch, 1, vocab)).squeeze(1)]
    tokens = [row_logits[0].argmax(dim=-1)]
    position = x.positions.gather(1, last[:, None]).squeeze(1)
    past = x.past_lens + last + 1
    one = torch.ones(batch, 1, 1, dtype=x.row_mask.dtype, device=x.row_mask.device)
    zero = torch.zeros_like(x.first_row)
    for step in range(1, steps):
        x_step = dataclasses.replace(
            x, token_ids=tokens[-1][:, None], positions=(position + step)[:, None],
            slots=x.chain_slots[:, step - 1:step], past_lens=past + step - 1, row_mask=one, first_row=zero,
            drafts=zero)
        row_logits.append(forward(x_step)[:, 0])
        tokens.append(row_logits[-1].argmax(dim=-1))
    return torch.stack(tokens, dim=1), torch.stack(row_logits, dim=1)
