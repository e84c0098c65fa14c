"""`specserve bench runtime` and `bench spec --quick` on smollm2-135m: the JSON carries every
documented figure, numbers are positive, the greedy contract holds, and the transformers twin
computes our logits (a correctness check, not a timing one: no timed assertions here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.bench.bench_prompts import CATEGORIES, load_prompts
from cluster.cli import main


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_prompt_set_covers_every_category() -> None:
    prompts = load_prompts(list(CATEGORIES), per_category=3)
    assert [p.category for p in prompts] == [c for c in CATEGORIES for _ in range(3)]
    assert len({p.id for p in prompts}) == len(prompts)


def test_bench_runtime_json(smollm2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runtime.json"
    assert main(["bench", "runtime", "--models", "smollm2-135m", "--contexts", "16", "40", "--max-k", "3",
                 "--repeats", "2", "--warmup", "0", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["environment"]["torch_threads"] == 2
    (model,) = result["models"]
    assert model["model"] == "smollm2-135m" and positive(model["parameters"])
    assert [c["context"] for c in model["contexts"]] == [16, 40]
    for c in model["contexts"]:
        assert positive(c["decode_ms"]) and positive(c["hf_decode_ms"]) and positive(c["ours_vs_hf"])
        assert positive(c["prefill_ms"]) and c["prefill_tok_s"] == pytest.approx(c["context"] / c["prefill_ms"] * 1e3)
        assert len(c["samples_ms"]["prefill"]) == 2
        assert [s["tokens"] for s in c["score"]] == [1, 2, 3]
        assert c["score"][0]["ratio"] == 1.0
        assert all(positive(s["ms"]) and positive(s["ratio"]) for s in c["score"])
        assert len(c["samples_ms"]["hf"]) == 2 and all(len(v) == 2 for v in c["samples_ms"]["ours"].values())
        assert c["hf_logits_max_abs_diff"] < 1e-3  # the twin shares our weights and KV: same logits
    printed = capsys.readouterr().out
    assert "ours/hf" in printed and "prefill ms" in printed


def test_bench_spec_quick_json(smollm2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "spec.json", tmp_path / "spec.png"
    assert main(["bench", "spec", "--quick", "--categories", "copy-edit", "qa", "--max-tokens", "8",
                 "--json-out", str(out), "--plot", str(plot)]) == 0
    result = json.loads(out.read_text())
    assert plot.stat().st_size > 0
    assert result["settings"]["model"] == "smollm2-135m"
    assert [p["category"] for p in result["prompts"]] == ["copy-edit", "qa"]
    labels = [r["label"] for r in result["results"]]
    assert labels == ["plain", "ngram k=2", "ngram k=auto"]
    for r in result["results"]:
        assert r["temperature"] == 0.0 and r["batch"] == 1 and r["contract"] == "greedy"
        assert r["output_tokens"] > 0 and positive(r["wall_seconds"]) and positive(r["tokens_per_second"])
        assert positive(r["speedup_vs_plain"]) and positive(r["speedup_vs_hf_plain"])
        assert positive(r["speedup_vs_hf_peer"])
        assert set(r["by_category"]) == {"copy-edit", "qa"}
        assert set(r["time_split_seconds"]) == {"draft", "verify", "reconcile", "plan_other", "outside"}
        assert positive(r["time_split_seconds"]["verify"])
        if r["draft"] == "ngram":
            assert r["hf_peer"] == "prompt_lookup"
            assert r["same_output_as_plain"] == 1.0  # greedy contract: output equals plain decoding
            if r["k"] == "auto" and "acceptance" not in r:
                continue  # auto may choose plain decoding throughout (its measured costs say drafts do not pay)
            acc = r["acceptance"]
            assert acc["rounds"] > 0 and len(acc["survival"]) >= 1
            assert all(0.0 <= s <= 1.0 for s in acc["survival"])
    assert {h["mode"] for h in result["hf"]} == {"plain", "prompt_lookup"}
    assert result["hf_settings"]["dtype"] == "torch.bfloat16"  # its own weights, as a CPU user loads them
    assert all(h["output_tokens"] > 0 and positive(h["tokens_per_second"]) for h in result["hf"])
    assert "vs hf peer" in capsys.readouterr().out


def test_bench_spec_repeats_batches_in_rotating_order(smollm2_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """--repeats 2 at batch 2: every config runs its prompts twice, the order rotated, and its figures sum both
    runs (greedy: the same tokens each time)."""
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--quick", "--categories", "copy-edit", "qa", "--batches", "2", "--ks", "2",
                 "--max-tokens", "4", "--repeats", "2", "--no-hf", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["repeats"] == 2
    rows = {r["label"]: r for r in result["results"]}
    assert set(rows) == {"plain", "ngram k=2"} and all(r["batch"] == 2 for r in rows.values())
    assert all(r["output_tokens"] == 2 * 2 * 4 for r in rows.values())  # 2 runs x 2 prompts x 4 tokens
    assert rows["ngram k=2"]["same_output_as_plain"] == 1.0
    err = capsys.readouterr().err
    assert "repeat 1/2" in err and "repeat 2/2" in err
    runs = [line.split(": ")[2] for line in err.splitlines() if "batch 2 2 prompts:" in line]
    assert runs == ["plain", "ngram k=2", "ngram k=2", "plain"]  # the second repeat starts one config later


def test_bench_precision(smollm2_dir: Path) -> None:
    """Both dtypes score the shipped text and time interleaved decode steps; bf16's perplexity stays near fp32's."""
    from cluster.bench.precision import format_precision, run_precision_bench

    result = run_precision_bench("smollm2-135m", ["float32", "bfloat16"], decode_steps=3)
    rows = result["dtypes"]
    assert set(rows) == {"float32", "bfloat16"} and result["tokens"] > 300
    assert rows["float32"]["top1_agreement_vs_float32"] == 1.0 and rows["bfloat16"]["top1_agreement_vs_float32"] > 0.9
    assert abs(rows["bfloat16"]["perplexity"] / rows["float32"]["perplexity"] - 1) < 0.02
    assert all(positive(r["decode_ms"]) and positive(r["decode_speedup_vs_float32"]) for r in rows.values())
    from model_runtime.cpu_kernels import active

    path = active()  # every dtype's linears on this CPU's kernel path (float32 on the avx512 build where AMX runs)
    assert rows["float32"]["linear_kernel"] == ("avx512" if path == "amx" else path)
    assert rows["bfloat16"]["linear_kernel"] == path
    assert "bfloat16" in format_precision(result)


def test_bench_spec_suffix_trees_and_chains(smollm2_dir: Path, tmp_path: Path) -> None:
    """`--drafts suffix --tree-nodes 0 12`: suffix chains and trees side by side, greedy, each equal to plain
    decoding, the tree rounds in the acceptance figures."""
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--quick", "--categories", "copy-edit", "--drafts", "ngram", "suffix",
                 "--tree-nodes", "0", "12", "--ks", "4", "--max-tokens", "24", "--no-hf", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["label"]: r for r in result["results"]}
    assert set(rows) == {"plain", "ngram k=4", "suffix k=4 chain", "suffix k=4 tree<=12"}
    assert all(rows[label]["same_output_as_plain"] == 1.0 for label in rows if label != "plain")
    assert rows["suffix k=4 chain"]["acceptance"]["tree_rounds"] == 0
    assert rows["suffix k=4 tree<=12"]["acceptance"]["tree_rounds"] > 0
    assert rows["suffix k=4 tree<=12"]["tree_nodes"] == 12
