"""Judging the samples of `specserve check exact`, one test per (prompt, position), and the report.

Position t is tested on the samples whose first t - 1 tokens equal the most common (t - 1)-token prefix
(the modal prefix): their t-th tokens against p( . | prompt, prefix) from the target alone
(cluster/check/reference.py), with Pearson's chi-square (cluster/check/stats.py).

Outcome per test: `pass` (p-value >= alpha and power >= min_power), `differs` (p-value < alpha, or a token
the target gives probability 0), `underpowered` (no evidence against exactness, but too few samples to have
detected a deviation of the stated total variation). The run passes only if every test passes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.check.reference import TargetReference
from cluster.check.settings import CheckSettings, PromptSamples
from cluster.check.stats import Cell, Fit, fit

PASS, DIFFERS, UNDERPOWERED = "pass", "differs", "underpowered"
EXIT_CODES = {PASS: 0, DIFFERS: 1, UNDERPOWERED: 3}  # 2: usage or runtime error (as `specserve generate`)


def modal_prefix(samples: Sequence[tuple[int, ...]], length: int) -> tuple[tuple[int, ...], list[int]]:
    """The most common `length`-token prefix of the samples (ties: the smallest) and the next token of each
    sample that has it."""
    if length == 0:
        return (), [s[0] for s in samples]
    counts = Counter(s[:length] for s in samples)
    best = max(counts.values())
    prefix = min(p for p, c in counts.items() if c == best)
    return prefix, [s[length] for s in samples if s[:length] == prefix]


@dataclass(frozen=True)
class PositionResult:
    prompt_index: int
    position: int
    prefix: tuple[int, ...]  # the modal prefix the position is conditioned on
    prefix_share: float  # the fraction of the prompt's samples that have it
    fit: Fit
    power: float
    outcome: str
    samples_needed: int | None  # for the stated power by this test (None: out of reach)

    def reason(self, alpha: float, tv: float, min_power: float) -> str:
        if self.fit.outside_support:
            return (f"{self.fit.outside_support} sample(s) are tokens the target gives probability 0 "
                    f"(outside its top-k/top-p support)")
        if self.outcome == DIFFERS:
            return f"p-value {self.fit.p_value:.3g} < alpha {alpha:g}"
        if self.outcome == UNDERPOWERED:
            need = "far more" if self.samples_needed is None else f"~{self.samples_needed}"
            return (f"power {self.power:.2f} < {min_power:g} against TV {tv:g} with {self.fit.samples} samples "
                    f"({need} needed by this {self.fit.test} test)")
        return "ok"


def judge(prompt_index: int, position: int, samples: PromptSamples, reference: TargetReference,
          settings: CheckSettings) -> PositionResult:
    prefix, next_tokens = modal_prefix(samples.tokens, position - 1)
    result = fit(next_tokens, reference.probs(samples.prompt_ids, prefix))
    power = result.power(settings.alpha, settings.tv)
    if result.outside_support or result.p_value < settings.alpha:
        outcome = DIFFERS
    elif power < settings.min_power:
        outcome = UNDERPOWERED
    else:
        outcome = PASS
    needed = None if outcome == PASS else result.samples_for_power(settings.alpha, settings.tv, settings.min_power)
    return PositionResult(prompt_index, position, prefix, len(next_tokens) / len(samples.tokens), result, power,
                          outcome, needed)


def overall(results: Sequence[PositionResult]) -> str:
    outcomes = {r.outcome for r in results}
    return DIFFERS if DIFFERS in outcomes else UNDERPOWERED if UNDERPOWERED in outcomes else PASS


@dataclass
class CheckReport:
    model: str
    draft: str
    where: str  # "in process" or the server's address
    settings: CheckSettings
    prompts: list[PromptSamples]
    results: list[PositionResult]
    inject_bias: bool
    sample_seconds: float
    reference_seconds: float
    # in process: the engine's token-tree rounds ({"rounds", "tree_rounds", "tree_nodes", "accepted_by_rank"})
    trees: dict[str, Any] | None = None
    # in process: a draft model's n-gram lookup rounds ({"rounds", "lookup_rounds", "proposed", "accepted"})
    lookups: dict[str, Any] | None = None

    @property
    def outcome(self) -> str:
        return overall(self.results)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    def to_json(self, decode: Callable[[Sequence[int]], str]) -> dict[str, Any]:
        s = self.settings

        def cell(c: Cell) -> dict[str, Any]:
            label = f"other ({len(c.tokens)} tokens)" if c.pooled else decode(c.tokens)
            return {"tokens": list(c.tokens) if not c.pooled else None, "text": label, "observed": c.observed,
                    "expected": round(c.expected, 3)}

        return {
            "model": self.model, "draft": self.draft, "where": self.where, "inject_bias": self.inject_bias,
            "settings": {**dataclasses.asdict(s), "positions": list(s.positions), "contract": s.contract},
            "outcome": self.outcome, "exit_code": self.exit_code,
            "sample_seconds": round(self.sample_seconds, 2), "reference_seconds": round(self.reference_seconds, 2),
            "trees": self.trees, "lookups": self.lookups,
            "prompts": [{"prompt": p.prompt, "prompt_token_ids": p.prompt_ids, "first_seed": p.first_seed,
                         "samples": len(p.tokens), "drafts_proposed": p.proposed, "drafts_accepted": p.accepted,
                         "drafts_forced": p.forced}
                        for p in self.prompts],
            "positions": [{
                "prompt_index": r.prompt_index, "position": r.position, "prefix": list(r.prefix),
                "prefix_text": decode(r.prefix), "prefix_share": round(r.prefix_share, 4),
                "samples": r.fit.samples, "support": r.fit.support, "cells": len(r.fit.cells),
                "test": r.fit.test, "statistic": r.fit.statistic, "df": r.fit.df, "rest_mass": r.fit.rest_mass,
                "p_value": r.fit.p_value, "tv": r.fit.tv, "tv_noise": r.fit.tv_noise, "outside_support": r.fit.outside_support, "power": r.power,
                "outcome": r.outcome, "reason": r.reason(s.alpha, s.tv, s.min_power),
                "samples_needed": r.samples_needed, "worst_cells": [cell(c) for c in r.fit.worst()],
            } for r in self.results],
        }

    def render(self, decode: Callable[[Sequence[int]], str]) -> str:
        s = self.settings
        tests = len(self.results)
        lines = [
            f"specserve check exact: {self.model}, draft {self.draft}, {self.where}"
            + (" -- INJECTED BIAS (negative control)" if self.inject_bias else ""),
            f"  {s.contract} contract, temperature {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g}, "
            f"k {'auto' if s.k is None else s.k}; {s.n} samples per prompt (seeds from {s.seed}), positions "
            f"{','.join(map(str, s.positions))}",
            f"  each test: alpha {s.alpha:g} (family of {tests}: false alarm <= {min(1.0, tests * s.alpha):.2g}), "
            f"power >= {s.min_power:g} against total variation {s.tv:g}",
            f"  sampling {self.sample_seconds:.1f}s, reference {self.reference_seconds:.1f}s",
        ]
        if s.constraint is not None or s.logit_bias:
            value = s.constraint.value if s.constraint is not None else ""
            what = ([f"{s.constraint.kind} constraint '{_short(value, 40)}'"] if s.constraint is not None else []) + (
                [f"logit bias on {len(s.logit_bias)} token(s)"] if s.logit_bias else [])
            lines.insert(2, f"  constrained: {', '.join(what)} (the reference masks and biases as the engine)")
        if self.trees is not None:
            t = self.trees
            lines.append(f"  token trees: {t['tree_rounds']} of {t['rounds']} drafting rounds, {t['tree_nodes']} nodes; "
                         f"accepted nodes by sibling rank {t['accepted_by_rank']}")
        if self.lookups is not None:
            lk = self.lookups
            lines.append(f"  n-gram lookups (draft_lookup): {lk['lookup_rounds']} of {lk['rounds']} drafting rounds, "
                         f"{lk['accepted']} of {lk['proposed']} drafts accepted")
        by_prompt: dict[int, list[PositionResult]] = {}
        for r in self.results:
            by_prompt.setdefault(r.prompt_index, []).append(r)
        for j, prompt in enumerate(self.prompts):
            lines.append(f"prompt {j + 1}: {prompt.prompt!r} ({len(prompt.prompt_ids)} tokens; drafts proposed "
                         f"{prompt.proposed}, accepted {prompt.accepted})")
            if prompt.proposed == 0:
                lines.append("  WARNING: no drafts were proposed: this prompt tested plain decoding only")
            lines.append(f"  {'pos':>3} {'prefix':<18} {'share':>5} {'samples':>7} {'X^2|off':>9} {'df':>4} "
                         f"{'p-value':>8} {'TV':>6} {'noise':>6} {'power':>5}  result")
            for r in by_prompt.get(j, []):
                f = r.fit
                statistic = f"{f.statistic:.2f}" if f.test == "chi-square" else f"off {int(f.statistic)}"
                df = str(f.df) if f.test == "chi-square" else "bin"
                lines.append(f"  {r.position:>3} {_short(decode(r.prefix)):<18} {r.prefix_share:>5.2f} {f.samples:>7} "
                             f"{statistic:>9} {df:>4} {f.p_value:>8.3g} {f.tv:>6.3f} {f.tv_noise:>6.3f} "
                             f"{r.power:>5.2f}  {r.outcome}")
                worst = ", ".join(
                    f"{_short(f'other ({len(c.tokens)})' if c.pooled else decode(c.tokens), 14)} "
                    f"{c.observed} vs {c.expected:.1f}" for c in f.worst(3))
                lines.append(f"      worst cells (observed vs expected): {worst}")
                if r.outcome != PASS:
                    lines.append(f"      {r.outcome}: {r.reason(s.alpha, s.tv, s.min_power)}")
        lines.append(self.verdict())
        return "\n".join(lines)

    def verdict(self) -> str:
        s = self.settings
        failing = [r for r in self.results if r.outcome == self.outcome]
        where = "; ".join(f"prompt {r.prompt_index + 1} position {r.position}" for r in failing)
        if self.outcome == PASS:
            return (f"PASS: every position fits the target's distribution at alpha {s.alpha:g}, with power >= "
                    f"{s.min_power:g} against total variation {s.tv:g}")
        if self.outcome == DIFFERS:
            return (f"FAIL (distribution differs): {where}. The sampled tokens do not follow the target model's "
                    "distribution; see docs/check-exact.md for what to do.")
        # the modal prefixes keep about the same share of the samples as --n grows
        ratios = [r.samples_needed / r.fit.samples for r in failing if r.samples_needed is not None]
        hint = (f"about {math.ceil(s.n * max(ratios))} samples per prompt (--n) would do" if ratios
                else "raise --tv or use other prompts")
        return (f"INCONCLUSIVE (not enough samples): {where}. No evidence against exactness, but the test could "
                f"have missed a deviation of total variation {s.tv:g}; {hint}.")


def _short(text: str, width: int = 18) -> str:
    text = repr(text)[1:-1]
    return text if len(text) <= width else text[: width - 1] + "~"
