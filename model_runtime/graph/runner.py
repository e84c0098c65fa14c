"""A model's steps through captured programs: CausalLM.forward_seqs' contract, and the greedy verdict and draft chain
with one host read each.

    runner = CapturedRunner(model, num_blocks, block_size, buckets, mode="cuda-graph", chain=k)
    runner.warm_up()                                 every bucket captured (compiled) on padding inputs
    runner.forward_seqs(seqs) -> [logits_i]          a step within a bucket: staged, replayed; else the eager forward
    runner.verify_greedy(seqs, drafts) -> verdicts   accepted drafts and the next token per sequence
    runner.draft_greedy(seqs, chain_slots) -> drafts a draft model's k greedy tokens per sequence, one program

The runner owns the KV pool: the ledger's `num_blocks`, then the scratch blocks the padding rows write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from model_runtime.batch import SeqInput
from model_runtime.graph.buckets import Bucket, Buckets, smallest_holding
from model_runtime.graph.capture import Backend, CapturedSteps, WarmUp
from model_runtime.graph.greedy import greedy_chain, greedy_verdict
from model_runtime.graph.modes import CaptureMode
from model_runtime.graph.staging import Scratch, StepInputs, needed_blocks, stage
from model_runtime.graph.static_forward import StaticModel, static_forward
from model_runtime.model import CausalLM


@dataclass(frozen=True)
class Verdict:
    """One verified chain: how many of its drafts the target's argmax accepts, and the token after them."""

    accepted: int
    next_token: int


def verify_program(model: StaticModel, x: StepInputs) -> tuple[torch.Tensor, ...]:
    """(logits [B, R, V], argmax [B, R], accepted [B], next token [B])."""
    logits = static_forward(model, x)
    return (logits, *greedy_verdict(logits, x))


def chain_program(model: StaticModel, x: StepInputs) -> tuple[torch.Tensor, ...]:
    """(tokens [B, S], logits [B, S, V]) of a draft's greedy chain."""
    return greedy_chain(partial(static_forward, model), x)


def _rows_wanted(seq: SeqInput) -> int:
    n = len(seq.token_ids)
    return {"all": n, "last": 1, "none": 0}.get(seq.logits, seq.logits)  # type: ignore[call-overload, no-any-return]


class CapturedRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, buckets: Buckets,
                 mode: CaptureMode = "eager", chain: int = 1, backend: Backend = "inductor") -> None:
        self.model, self.block_size, self.buckets, self.chain = model, block_size, buckets, chain
        padding_rows = max(buckets.batches) * max(max(buckets.rows), chain)
        scratch_blocks = -(-padding_rows // block_size)
        self.kv = model.allocate_kv(num_blocks + scratch_blocks, block_size)
        self.scratch = Scratch(num_blocks * block_size, scratch_blocks * block_size)
        static = StaticModel.of(model, self.kv)
        pool = (*self.kv.k, *self.kv.v)
        self.verify = CapturedSteps(partial(verify_program, static), model.device, mode, 1, backend, pool)
        self.draft = CapturedSteps(partial(chain_program, static), model.device, mode, chain, backend, pool) \
            if chain > 1 else None

    def _padding(self, chain: int) -> Callable[[Bucket], torch.Tensor]:
        return lambda bucket: stage([], [], bucket, self.block_size, self.scratch, chain)

    @torch.inference_mode()  # as the steps run: a compiled program's guards see the same mode
    def warm_up(self, verify: list[Bucket] | None = None, draft: list[Bucket] | None = None) -> dict[str, WarmUp]:
        """Capture the verify program on `verify` (default every bucket) and the draft chain's on `draft` (default:
        every bucket of one row: a chain's catch-up is mostly a row)."""
        every = self.buckets.all()
        out = {"verify": self.verify.warm_up(every if verify is None else verify, self._padding(1))}
        if self.draft is not None:
            rows_one = [b for b in every if b.rows == self.buckets.rows[0]]
            out["draft"] = self.draft.warm_up(rows_one if draft is None else draft, self._padding(self.chain))
        return out

    def _fit(self, steps: CapturedSteps, seqs: list[SeqInput], chain: int) -> Bucket | None:
        rows = max(len(s.token_ids) for s in seqs)
        blocks = max(needed_blocks(s, self.block_size, chain) for s in seqs)
        return smallest_holding(steps.buckets, len(seqs), rows, blocks)

    @torch.inference_mode()
    def forward_seqs(self, seqs: list[SeqInput]) -> list[torch.Tensor]:
        """CausalLM.forward_seqs(seqs, self.kv): each sequence's wanted rows' logits [rows_i, V] float32."""
        bucket = self._fit(self.verify, seqs, 1)
        if bucket is None:
            return self.model.forward_seqs(seqs, self.kv)
        staged = stage(seqs, [0] * len(seqs), bucket, self.block_size, self.scratch)
        logits = self.verify.run(bucket, staged)[0]
        return [logits[b, len(s.token_ids) - _rows_wanted(s):len(s.token_ids)].clone() for b, s in enumerate(seqs)]

    @torch.inference_mode()
    def verify_greedy(self, seqs: list[SeqInput], drafts: list[int]) -> list[Verdict]:
        """Each sequence's last `drafts[i]` rows are drafts: the greedy verdict, decided on the device (one read)."""
        bucket = self._fit(self.verify, seqs, 1)
        if bucket is None:  # the eager forward, the same verdict on its logits
            logits = self.model.forward_seqs([dataclasses.replace(s, logits="all") for s in seqs], self.kv)
            verdicts = []
            for seq, drafted, rows in zip(seqs, drafts, logits, strict=True):
                argmax, first = rows.argmax(-1).tolist(), len(seq.token_ids) - 1 - drafted
                accepted = 0
                while accepted < drafted and argmax[first + accepted] == seq.token_ids[first + accepted + 1]:
                    accepted += 1
                verdicts.append(Verdict(accepted, argmax[first + accepted]))
            return verdicts
        staged = stage(seqs, drafts, bucket, self.block_size, self.scratch)
        _, _, accepted, next_token = self.verify.run(bucket, staged)
        both = torch.stack([accepted, next_token], dim=1)[:len(seqs)].tolist()  # the one read
        return [Verdict(a, t) for a, t in both]

    @torch.inference_mode()
    def draft_greedy(self, seqs: list[SeqInput], chain_slots: list[list[int]]) -> list[list[int]]:
        """A draft model's `chain` greedy tokens per sequence after its catch-up rows `seqs` (the chain's later
        tokens' K/V to `chain_slots`, the table's next slots): one program, one read."""
        assert self.draft is not None, "a runner made with chain=1 drafts no chain"
        bucket = self._fit(self.draft, seqs, self.chain)
        if bucket is None:  # the eager forward, step by step
            return self._draft_eager(seqs, chain_slots)
        staged = stage(seqs, [0] * len(seqs), bucket, self.block_size, self.scratch, self.chain, chain_slots)
        tokens, _ = self.draft.run(bucket, staged)
        return tokens[:len(seqs)].tolist()

    def _draft_eager(self, seqs: list[SeqInput], chain_slots: list[list[int]]) -> list[list[int]]:
        logits = self.model.forward_seqs([dataclasses.replace(s, logits="last") for s in seqs], self.kv)
        tokens = [[int(rows[-1].argmax())] for rows in logits]
        for step in range(1, self.chain):
            steps = [SeqInput([drafted[-1]], s.past_len + len(s.token_ids) + step - 1, s.block_table,
                              [slots[step - 1]], logits="last") for s, slots, drafted in zip(seqs, chain_slots, tokens,
                                                                                             strict=True)]
            for drafted, rows in zip(tokens, self.model.forward_seqs(steps, self.kv), strict=True):
                drafted.append(int(rows[-1].argmax()))
        return tokens
