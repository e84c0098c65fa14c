"""`specserve check exact` end to end on SmolLM2-135M with n-gram drafts, in process (seconds each).

Setting: the prompt "red, green, blue, red, green, blue, red," at temperature 0.7, top-p 0.9, k = 3. The
n-gram lookup drafts " green" first, which the target gives p = 0.455 after the transform (" and" 0.37,
" blue" 0.17): about half the rounds reject it, so the residual path carries half the mass of position 1.

Passing run: n = 240, positions 1 and 2, power >= 0.8 required against total variation 0.2. Position 1
has 3 cells (df 2): lambda = 4 * 240 * 0.2^2 = 38 gives power ~0.99; position 2 follows the modal prefix
" green", where top-p leaves one token (",") so the test is exact match on ~110 samples (power ~1).
A correct engine fails a test with probability alpha = 0.001 (x 2 tests); the seeds are fixed, so the
outcome is deterministic for a given build and machine.

Negative control (`--inject-bias`: after a rejection resample from p, not the residual): position 1 then
emits " green" with probability p + p(1 - p) = 0.70 instead of 0.455 (total variation p(1 - p) = 0.248).
Over the 3 cells at n = 240 the noncentrality is 240 * sum (alt - p)^2 / p = 59.5, so the chi-square test
at alpha 0.001 (df 2, critical value 13.8) misses it with probability ~1e-5 (noncentral chi-square); the
other position only adds chances to detect it. Nine seeds (0, 240, ..., 1920) were run by hand while writing
this test: every one failed at position 1 with p-value <= 6e-11, " green" the worst cell; the correct engine
passed with each of the same seeds. The test below runs two.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cluster.check.exact import check_in_process
from cluster.check.report import DIFFERS, PASS
from cluster.check.settings import CheckSettings
from cluster.cli.main import main

PROMPT = "red, green, blue, red, green, blue, red,"
SAMPLED = ["--temperature", "0.7", "--top-p", "0.9", "--k", "3", "--positions", "1,2"]


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The check's forwards are small: on a shared 2-core machine one torch thread is several times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check(smollm2_dir: Path, *flags: str, out: Path) -> tuple[int, dict]:
    code = main(["check", "exact", "--model", str(smollm2_dir), "--draft", "ngram", "--prompt", PROMPT, *flags,
                 "--json-out", str(out)])
    return code, json.loads(out.read_text())


def test_smollm2_ngram_passes(smollm2_dir: Path, tmp_path: Path) -> None:
    code, report = check(smollm2_dir, *SAMPLED, "--n", "240", "--tv", "0.2", out=tmp_path / "r.json")
    assert code == 0, [(p["position"], p["outcome"], p["reason"]) for p in report["positions"]]
    assert report["outcome"] == PASS and [p["outcome"] for p in report["positions"]] == [PASS, PASS]
    prompt = report["prompts"][0]
    assert prompt["samples"] == 240 and prompt["first_seed"] == 0
    assert 0 < prompt["drafts_accepted"] < prompt["drafts_proposed"]  # both the accept and the residual path ran
    first, second = report["positions"]
    assert first["test"] == "chi-square" and first["samples"] == 240 and first["power"] >= 0.8
    assert second["prefix_text"] == " green" and second["test"] == "binomial"


@pytest.mark.parametrize("seed", [0, 4800])
def test_injected_bias_fails(smollm2_dir: Path, tmp_path: Path, seed: int) -> None:
    code, report = check(smollm2_dir, *SAMPLED, "--n", "240", "--tv", "0.2", "--seed", str(seed), "--inject-bias",
                         out=tmp_path / "r.json")
    assert code == 1 and report["outcome"] == DIFFERS and report["inject_bias"]
    first = report["positions"][0]
    assert first["outcome"] == DIFFERS and first["p_value"] < 1e-3
    assert first["worst_cells"][0]["text"] == " green"  # the draft token got the extra mass


def test_too_few_samples_is_inconclusive_not_a_pass(smollm2_dir: Path, tmp_path: Path) -> None:
    code, report = check(smollm2_dir, "--temperature", "1", "--positions", "1", "--n", "24", out=tmp_path / "r.json")
    assert code == 3 and report["outcome"] == "underpowered"
    assert report["positions"][0]["samples_needed"] > 24


def test_greedy_is_exact_match(smollm2_dir: Path) -> None:
    settings = CheckSettings(temperature=0.0, n=24, positions=(1, 2, 3), tv=0.1)
    report, _ = check_in_process(str(smollm2_dir), "ngram", [PROMPT], settings, window=8)
    assert report.outcome == PASS and report.settings.contract == "greedy"
    for result in report.results:
        assert result.fit.test == "binomial" and result.fit.rest_mass == 0.0 and result.fit.statistic == 0
        assert result.prefix_share == 1.0 and result.power == pytest.approx(1 - 0.9 ** 24)


def test_inject_bias_is_refused_with_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "exact", "--server", "127.0.0.1:1", "--inject-bias", "--n", "4"]) == 2
    assert "--inject-bias works in process only" in capsys.readouterr().err
