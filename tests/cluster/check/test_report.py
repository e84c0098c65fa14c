"""Judging (cluster/check/report.py) on a tiny random-weight target, without the engine: samples drawn by
plain sampling from the target's own distributions pass, samples from a shifted distribution fail as
`differs`, too few samples come out `underpowered`; the modal prefix conditions later positions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.check.reference import TargetReference
from cluster.check.report import (
    DIFFERS,
    EXIT_CODES,
    PASS,
    UNDERPOWERED,
    CheckReport,
    judge,
    modal_prefix,
    overall,
)
from cluster.check.settings import CheckSettings, PromptSamples
from tests.cluster.engine.engine_helpers import load_target
from tests.model_runtime.random_checkpoint import make_random_checkpoint

VOCAB = 6
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> TargetReference:
    checkpoint = make_random_checkpoint(tmp_path_factory.mktemp("check") / "t", seed=5, vocab_size=VOCAB,
                                        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                        intermediate_size=64, init_std=0.1)
    return TargetReference(load_target(Path(checkpoint)), CheckSettings().sampling())


def draw(reference: TargetReference, n: int, length: int, seed: int, shift: float = 0.0) -> PromptSamples:
    """n plain samples of `length` tokens; `shift` moves that much probability of every position onto token 0."""
    generator = torch.Generator().manual_seed(seed)
    cache: dict[tuple[int, ...], torch.Tensor] = {}
    samples = PromptSamples("p", PROMPT, first_seed=seed)
    for _ in range(n):
        prefix: tuple[int, ...] = ()
        for _ in range(length):
            if prefix not in cache:
                p = reference.probs(PROMPT, prefix)
                cache[prefix] = (1 - shift) * p + shift * torch.nn.functional.one_hot(torch.tensor(0), VOCAB)
            prefix = (*prefix, int(torch.multinomial(cache[prefix], 1, generator=generator)))
        samples.tokens.append(prefix)
    return samples


def test_modal_prefix_takes_the_most_common_and_breaks_ties_low() -> None:
    samples = [(1, 2, 3), (1, 2, 4), (0, 5, 5), (0, 5, 1), (1, 3, 0)]
    assert modal_prefix(samples, 0) == ((), [1, 1, 0, 0, 1])
    assert modal_prefix(samples, 2) == ((0, 5), [5, 1])  # (0, 5) and (1, 2) both twice: the smaller wins
    assert modal_prefix(samples, 1) == ((1,), [2, 2, 3])


def test_samples_from_the_target_pass(reference: TargetReference) -> None:
    settings = CheckSettings(n=3000, positions=(1, 2), tv=0.1)
    samples = draw(reference, settings.n, 2, seed=11)
    results = [judge(0, t, samples, reference, settings) for t in settings.positions]
    assert [r.outcome for r in results] == [PASS, PASS], [(r.fit.p_value, r.power) for r in results]
    first, second = results
    assert first.prefix == () and first.fit.samples == 3000 and first.prefix_share == 1.0
    assert len(second.prefix) == 1 and second.fit.samples == round(second.prefix_share * 3000)
    assert overall(results) == PASS and EXIT_CODES[overall(results)] == 0


def test_a_shifted_distribution_differs(reference: TargetReference) -> None:
    settings = CheckSettings(n=3000, positions=(1,), tv=0.1)
    samples = draw(reference, settings.n, 1, seed=12, shift=0.1)
    (result,) = [judge(0, 1, samples, reference, settings)]
    assert result.outcome == DIFFERS and result.fit.p_value < settings.alpha
    assert result.fit.worst(1)[0].tokens == (0,)  # the cell that got the extra mass
    assert EXIT_CODES[overall([result])] == 1


def test_too_few_samples_are_underpowered_not_a_pass(reference: TargetReference) -> None:
    settings = CheckSettings(n=60, positions=(1,), tv=0.1)
    result = judge(0, 1, draw(reference, settings.n, 1, seed=13), reference, settings)
    assert result.outcome == UNDERPOWERED and result.fit.p_value >= settings.alpha
    assert result.samples_needed is not None and result.samples_needed > 60
    assert result.fit.power_at(result.samples_needed, settings.alpha, settings.tv) >= settings.min_power
    assert EXIT_CODES[overall([result])] == 3


def test_report_renders_and_serializes_every_position(reference: TargetReference) -> None:
    settings = CheckSettings(n=200, positions=(1, 2), tv=0.3)
    samples = draw(reference, settings.n, 2, seed=14)
    results = [judge(0, t, samples, reference, settings) for t in settings.positions]
    report = CheckReport("tiny", "ngram", "in process", settings, [samples], results, False, 1.0, 0.1)
    text = report.render(lambda ids: " ".join(map(str, ids)))
    assert text.splitlines()[-1].startswith({PASS: "PASS", UNDERPOWERED: "INCONCLUSIVE", DIFFERS: "FAIL"}[
        report.outcome])
    data = report.to_json(lambda ids: " ".join(map(str, ids)))
    assert [p["position"] for p in data["positions"]] == [1, 2]
    assert data["exit_code"] == report.exit_code and data["settings"]["positions"] == [1, 2]
    assert all(p["worst_cells"] for p in data["positions"])
