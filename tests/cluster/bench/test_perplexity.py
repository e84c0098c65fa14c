"""`specserve bench perplexity` (cluster/bench/perplexity.py):

- unit: the windows against a hand-computed case of llama-perplexity's cut (len // n_ctx windows, the remainder
  dropped, BOS over each window's first token, only tokens first + 1 .. n_ctx - 1 counted, first = n_ctx / 2), its
  perplexity and "+/-" by hand, its log's final estimate parsed, and the report over fake runs (bitwise equal,
  differing, the ratio to llama.cpp); the CLI's flags reach the settings;
- model (SmolLM2-135M, 4 windows of 64 tokens of the shipped text): the in-process engine's perplexity equals
  exp(mean NLL) of a plain transformers float32 forward over the same windows and rows. float32 engine against
  transformers float32: measured relative difference 1.7e-6 (per-token |d| <= 3e-5; float32 kernels summing in
  another order), asserted < 2e-5. bfloat16 weights against float32: measured +0.32% here (and -0.37% at
  n_ctx 128; the bf16 checkpoint is another rounding of the weights), asserted < 2%.
The server path is checked live in tests/cluster/serving/live_api/test_perplexity_live.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.bench import perplexity as ppl
from cluster.bench.perplexity import IN_PROCESS, SERVER, Scores


# ---------------------------------------------------------------------- the windows
def test_windows_cut_as_llama_perplexity() -> None:
    tokens = list(range(100, 111))  # 11 tokens, n_ctx 4: 11 // 4 = 2 windows, the last 3 tokens dropped
    assert ppl.windows(tokens, 4) == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert ppl.windows(tokens, 4, bos=1) == [[1, 101, 102, 103], [1, 105, 106, 107]]
    assert ppl.windows(tokens, 5) == [[100, 101, 102, 103, 104], [105, 106, 107, 108, 109]]
    with pytest.raises(ValueError, match="at least 2 \\* n_ctx = 12"):
        ppl.windows(tokens, 6)  # llama-perplexity refuses fewer than 2 * n_ctx tokens


def test_only_the_second_half_of_a_window_counts() -> None:
    # n_ctx 6: prompt rows 0..4, row r = log p(token r+1 | tokens <= r); first = 3: rows 3, 4 (tokens 4, 5), that is
    # n_ctx - 1 - first = 2 per window, as llama-perplexity's count += n_ctx - first - 1
    rows = np.array([-0.5, -1.0, -1.5, -2.0, -2.5], np.float32)
    assert ppl.first_scored(6) == 3
    np.testing.assert_array_equal(ppl.scored_rows(rows, 6), [-2.0, -2.5])
    # odd n_ctx: first = 7 // 2 = 3, rows 3..5
    np.testing.assert_array_equal(ppl.scored_rows(np.arange(6, dtype=np.float32), 7), [3, 4, 5])
    with pytest.raises(ValueError, match="expected 5 prompt rows"):
        ppl.scored_rows(rows[:4], 6)


def test_estimate_by_hand() -> None:
    est = ppl.estimate(np.array([-1.0, -3.0], np.float32))
    # mean NLL 2, var (1 + 9) / 2 - 4 = 1, "+/-" = ppl * sqrt(1 / (2 - 1))
    assert est.ppl == pytest.approx(math.exp(2)) and est.uncertainty == pytest.approx(math.exp(2))
    assert est.tokens == 2
    assert ppl.estimate(np.array([-0.25] * 4)).uncertainty == 0.0


def test_bos_of_reads_what_the_tokenizer_prepends() -> None:
    class Tok:
        def __init__(self, bos: int | None, prepends: bool) -> None:
            self.bos_token_id, self.prepends = bos, prepends

        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": ([self.bos_token_id] if self.prepends else []) + [42]}

    assert ppl.bos_of(Tok(1, True)) == 1
    assert ppl.bos_of(Tok(151643, False)) is None  # Qwen2.5, SmolLM2: a BOS id, never prepended
    assert ppl.bos_of(Tok(None, False)) is None


def test_read_text_drops_one_trailing_newline_as_llama_does(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("a\nb\n\n", encoding="utf-8")
    assert ppl.read_text(path) == "a\nb\n"
    assert ppl.read_text().endswith("to dinner.")  # the shipped text
    assert "\r" not in ppl.read_text() and ppl.read_text().isascii()


def test_parse_llama_perplexity_log() -> None:
    log = ("0.03.579.037 I perplexity: calculating perplexity over 7 chunks, n_ctx=512, batch_size=2048, n_seq=4\n"
           "[1]2.1421,[2]2.9635,[3]2.9228,[4]2.6028,[5]3.4066,[6]4.4151,[7]5.3286,\n"
           "1.46.313.075 I Final estimate: PPL = 5.3286 +/- 0.27373\n")
    assert ppl.parse_llama_perplexity(log) == {"ppl": 5.3286, "uncertainty": 0.27373, "chunks": 7}
    with pytest.raises(RuntimeError, match="no final estimate"):
        ppl.parse_llama_perplexity("perplexity: you need at least 1024 tokens")


# ---------------------------------------------------------------------- the report
def fake_runs() -> list[Scores]:
    base = np.array([-1.0, -2.0, -0.5, -1.5], np.float32)
    nudged = base.copy()
    nudged[2] = np.nextafter(nudged[2], np.float32(0))  # one ulp
    return [Scores("bfloat16", IN_PROCESS, base, 3.0), Scores("q4", IN_PROCESS, base * 2, 2.0),
            Scores("q4", SERVER, nudged * 2, 4.0, {"url": "http://127.0.0.1:8000"}),
            Scores("bfloat16", SERVER, base.copy(), 5.0)]


META = {"model": "m", "text": "t.txt", "text_tokens": 40, "n_ctx": 8, "windows": 5, "scored_tokens": 15,
        "bos": None, "server": {"url": "http://127.0.0.1:8000", "model": "m", "dtype": "q4"}, "notes": ["n1"]}


def test_report_over_fake_runs() -> None:
    llama = {"ppl": 4.0, "uncertainty": 0.1, "chunks": 5, "command": ["llama-perplexity", "-m", "/x/m.gguf"],
             "seconds": 9.0}
    result = ppl.summarise(META, fake_runs(), llama)
    bf16, q4 = result["rows"]
    assert (bf16["dtype"], q4["dtype"]) == ("bfloat16", "q4")
    expected = math.exp(1.25)  # mean NLL of base
    assert bf16[IN_PROCESS]["ppl"] == pytest.approx(expected) and bf16[SERVER]["ppl"] == bf16[IN_PROCESS]["ppl"]
    assert bf16["server_vs_in_process"] == {"bitwise_equal": True, "max_abs_diff": 0.0, "ppl_diff": 0.0}
    assert bf16[IN_PROCESS]["vs_llamacpp"] == pytest.approx(expected / 4.0)
    assert q4[IN_PROCESS]["ppl"] == pytest.approx(math.exp(2.5))
    diff = q4["server_vs_in_process"]
    assert not diff["bitwise_equal"] and 0 < diff["max_abs_diff"] < 1e-6 and diff["ppl_diff"] != 0
    assert q4[SERVER]["url"] == "http://127.0.0.1:8000" and q4[SERVER]["seconds"] == 4.0
    text = ppl.format_perplexity(result)
    lines = text.splitlines()
    assert "5 windows, 15 tokens scored" in lines[0] and "BOS: none" in lines[0]
    assert "ours / llama.cpp" in lines[1]
    assert lines[2].startswith("bfloat16") and "bitwise equal" in lines[2] and f"{expected / 4:.4f}" in lines[2]
    assert lines[3].startswith("q4") and "differ: max |d|" in lines[3]
    assert lines[4].startswith("llama.cpp") and "4.0000 +/- 0.1000" in lines[4] and "m.gguf, 5 chunks" in lines[4]
    assert "serving m in q4" in text and "note: n1" in text


def test_report_without_server_or_llamacpp() -> None:
    result = ppl.summarise({**META, "server": None, "notes": []},
                           [r for r in fake_runs() if r.path == IN_PROCESS], None)
    assert all("server_vs_in_process" not in row and "vs_llamacpp" not in row[IN_PROCESS] for row in result["rows"])
    text = ppl.format_perplexity(result)
    assert "ours / llama.cpp" not in text and "llama.cpp " not in text
    assert all(line.split()[-1] == "-" for line in text.splitlines()[2:])


def test_cli_flags_reach_the_settings(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli import main

    seen: list[ppl.PerplexitySettings] = []

    def fake(settings: ppl.PerplexitySettings) -> dict:
        seen.append(settings)
        return ppl.summarise({**META, "server": None}, [r for r in fake_runs() if r.path == IN_PROCESS], None)

    monkeypatch.setattr(ppl, "run_perplexity_bench", fake)
    assert main(["bench", "perplexity"]) == 0
    assert main(["bench", "perplexity", "--model", "smollm2-135m", "--dtype", "q4", "bf16", "bfloat16", "--n-ctx",
                 "64", "--server", "127.0.0.1:8000", "--llamacpp", "--threads", "1"]) == 0
    default, given = seen
    assert (default.model, default.dtypes, default.n_ctx, default.server, default.llamacpp) == \
        ("qwen2.5-coder-1.5b", ("bfloat16", "q4"), 512, None, False)
    assert (given.model, given.dtypes, given.n_ctx, given.server, given.llamacpp, given.threads) == \
        ("smollm2-135m", ("q4", "bfloat16"), 64, "127.0.0.1:8000", True, 1)
    assert "bench perplexity: m" in capsys.readouterr().out


# ---------------------------------------------------------------------- the model
N_CTX, WINDOWS = 64, 4


def transformers_float32(checkpoint: Path, wins: list[list[int]]) -> np.ndarray:
    """The counted log-probabilities of `wins` from a plain transformers float32 forward (each window alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    first = ppl.first_scored(N_CTX)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor(wins)).logits.float(), -1)
    return np.concatenate([logprobs[i, first:N_CTX - 1].gather(1, torch.tensor(w[first + 1:])[:, None])[:, 0].numpy()
                           for i, w in enumerate(wins)])


@pytest.mark.model
@pytest.mark.timeout(240)
def test_in_process_perplexity_is_transformers_float32(smollm2_dir: Path) -> None:
    from cluster.engine.factory import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    tokens = list(tokenizer(ppl.read_text())["input_ids"])[:N_CTX * WINDOWS]
    wins = ppl.windows(tokens, N_CTX, ppl.bos_of(tokenizer))
    assert len(wins) == WINDOWS
    reference = ppl.estimate(transformers_float32(smollm2_dir, wins))
    assert reference.tokens == WINDOWS * (N_CTX - 1 - N_CTX // 2)
    exact = ppl.score_in_process(str(smollm2_dir), "float32", wins)
    bf16 = ppl.score_in_process(str(smollm2_dir), "bfloat16", wins)
    assert exact.dtype == "float32" and bf16.dtype == "bfloat16"
    rel_fp32 = ppl.estimate(exact.logprobs).ppl / reference.ppl - 1
    rel_bf16 = ppl.estimate(bf16.logprobs).ppl / reference.ppl - 1
    print(f"PPL transformers fp32 {reference.ppl:.6f}; ours fp32 {rel_fp32:+.3e}, bf16 {rel_bf16:+.3e}")
    assert abs(rel_fp32) < 2e-5
    assert abs(rel_bf16) < 0.02
