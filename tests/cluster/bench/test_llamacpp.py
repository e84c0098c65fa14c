"""llama.cpp beside our engine (`bench spec --llamacpp`): the aggregation and the printed view, the missing
package's error, the GGUF file llama.cpp reads; with llama-cpp-python installed, real runs on SmolLM2's GGUF
(skipped without it: it is an optional extra, not in `make setup` or CI). Those run llama.cpp on one thread:
torch has loaded OpenMP with its default wait policy by then (`--llamacpp` runs llama.cpp in a process of
its own: cluster/bench/llamacpp_process.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from cluster.bench.gguf_file import NoGGUFError, gguf_path
from cluster.bench.llamacpp import (
    INSTALL_HINT,
    PIN,
    LlamaCppMissingError,
    LlamaCppRun,
    require_llama_cpp,
    summarise,
    tables,
    text_equality,
)
from cluster.bench.llamacpp_native import BUILD_HINT, default_bin_dir
from cluster.cli import main
from model_runtime.registry import LocalParts, ModelSource
from model_runtime.weights_assemble import WeightIntegrityError


def run(pid: str, category: str, mode: str, tokens: list[int], text: str, seconds: float,
        calls: int = 0) -> LlamaCppRun:
    return LlamaCppRun(pid, category, mode, tuple(tokens), text, seconds, calls, 4 * calls)


RUNS = [
    run("c1", "code", "plain", [1, 2, 3, 4], "abcd", 2.0),
    run("c1", "code", "draft_model", [1, 2, 3, 4], "abcd", 1.0, calls=2),
    run("c1", "code", "prompt_lookup", [1, 2, 3, 4], "abcd", 4.0, calls=4),
    run("q1", "qa", "plain", [5, 6], "ef", 1.0),
    run("q1", "qa", "draft_model", [5, 7], "eg", 0.5, calls=1),
    run("q2", "qa", "plain", [8, 9], "hi", 1.0),
    run("q2", "qa", "draft_model", [8, 9], "hi", 1.0, calls=2),
]


def section(runs: list[LlamaCppRun], our_plain: dict[str, list[int]] | None = None) -> dict:
    settings = {"model_gguf": "/m/target.gguf", "draft_gguf": "/m/draft.gguf", "threads": 2, "draft_tokens": 4,
                "lookup_tokens": 10}
    return {"version": "0.3.36", "settings": settings, **summarise(runs, our_plain)}


def test_summarise_rates_ratios_and_text_equality() -> None:
    result = summarise(RUNS, our_plain={"c1": [1, 2, 3, 4], "q1": [5, 6], "q2": [8, 0]})
    modes = {m["mode"]: m for m in result["modes"]}
    assert list(modes) == ["plain", "draft_model", "prompt_lookup"]
    plain, draft, lookup = modes["plain"], modes["draft_model"], modes["prompt_lookup"]
    assert (plain["output_tokens"], plain["wall_seconds"], plain["tokens_per_second"]) == (8, 4.0, 2.0)
    assert plain["by_category"]["qa"]["tokens_per_second"] == 2.0 and plain["speedup_vs_plain"] == 1.0
    assert draft["tokens_per_second"] == 8 / 2.5 and draft["speedup_vs_plain"] == pytest.approx(1.6)
    assert draft["by_category_speedup_vs_plain"] == {"code": 2.0, "qa": pytest.approx((4 / 1.5) / 2.0)}
    assert draft["spec_text_equals_plain"] == {"c1": True, "q1": False, "q2": True}
    assert draft["same_text_fraction"] == pytest.approx(2 / 3)
    assert (draft["draft_calls"], draft["drafted_tokens"], draft["tokens_per_round"]) == (5, 20, 8 / 5)
    assert lookup["speedup_vs_plain"] == 0.5 and lookup["by_category_speedup_vs_plain"] == {"code": 0.5}
    assert lookup["spec_text_equals_plain"] == {"c1": True}
    assert plain["same_tokens_as_our_plain"] == pytest.approx(2 / 3)  # q2 differs from ours
    assert "spec_text_equals_plain" not in plain and "draft_calls" not in plain
    assert result["prompts"] == [
        {"id": "c1", "category": "code", "plain_output_tokens": 4,
         "spec_text_equals_plain": {"draft_model": True, "prompt_lookup": True}},
        {"id": "q1", "category": "qa", "plain_output_tokens": 2, "spec_text_equals_plain": {"draft_model": False}},
        {"id": "q2", "category": "qa", "plain_output_tokens": 2, "spec_text_equals_plain": {"draft_model": True}},
    ]


def test_summarise_without_plain_has_no_ratios() -> None:
    result = summarise([r for r in RUNS if r.mode == "draft_model"])
    (draft,) = result["modes"]
    assert draft["speedup_vs_plain"] is None and draft["by_category_speedup_vs_plain"] == {}
    assert "spec_text_equals_plain" not in draft and result["prompts"] == []


def test_text_equality_compares_text_not_tokens() -> None:
    plain = {"a": run("a", "qa", "plain", [1, 2], "xy", 1.0), "b": run("b", "qa", "plain", [3], "z", 1.0)}
    spec = {"a": run("a", "qa", "draft_model", [9], "xy", 1.0),  # other tokens, same text
            "c": run("c", "qa", "draft_model", [3], "z", 1.0)}  # no plain run: not compared
    assert text_equality(spec, plain) == {"a": True}


def test_tables_per_category_and_per_prompt() -> None:
    (title, headers, rows), (title2, headers2, rows2) = tables(section(RUNS))
    assert "llama.cpp 0.3.36" in title and "target.gguf" in title and "draft.gguf" in title
    assert headers == ["category", "plain tok/s", "draft_model tok/s", "x plain", "prompt_lookup tok/s", "x plain"]
    assert rows[0] == ["code", 2.0, 4.0, 2.0, 1.0, 0.5]
    assert rows[1][:4] == ["qa", 2.0, 4 / 1.5, pytest.approx(4 / 3)] and rows[1][4:] == [None, None]
    assert rows[2][0] == "all" and rows[2][3] == pytest.approx(1.6)
    assert "per prompt" in title2 and headers2[-2:] == ["draft_model =plain", "prompt_lookup =plain"]
    assert rows2 == [["c1", "code", 4, True, True], ["q1", "qa", 2, False, None], ["q2", "qa", 2, True, None]]


def test_missing_llama_cpp_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    with pytest.raises(LlamaCppMissingError) as err:
        require_llama_cpp()
    assert INSTALL_HINT in str(err.value) and PIN in str(err.value) and ".[llamacpp]" in str(err.value)


@pytest.mark.parametrize("flags", [["--llamacpp"], ["--llamacpp-only"], ["--llamacpp", "--llamacpp-python"]])
def test_cli_without_llama_cpp_exits_2_before_loading_models(
        flags: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Native binaries not built (or, with --llamacpp-python, the binding not installed): exit 2 saying how to get
    them, before any model loads."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "empty-cache"))  # a model load would fail differently
    monkeypatch.setenv("SPECSERVE_LLAMACPP_BIN", str(tmp_path / "no-binaries"))
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--quick", *flags, "--json-out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (INSTALL_HINT if "--llamacpp-python" in flags else BUILD_HINT) in err and "Traceback" not in err
    assert not out.exists() and not (tmp_path / "empty-cache").exists()


def make_source(tmp_path: Path, blobs: list[bytes], sha256: str | None = None) -> ModelSource:
    parts = []
    for i, blob in enumerate(blobs):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(blob)
    whole = b"".join(blobs)
    return ModelSource(name="tiny", upstream="test/tiny", role="test", parameters="0", quantization="Q4_K_M",
                       sha256=sha256 or hashlib.sha256(whole).hexdigest(), size_bytes=len(whole),
                       gguf_name="tiny.gguf", parts=LocalParts(tuple(parts)))


def test_gguf_assembled_once_verified(tmp_path: Path) -> None:
    source = make_source(tmp_path, [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7])
    path = gguf_path(source, cache_dir=tmp_path / "cache", progress=False)
    assert path == tmp_path / "cache" / "gguf" / "tiny.gguf"
    assert path.read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50 + b"c" * 7
    stamp = path.stat().st_mtime_ns
    (tmp_path / "part1").write_bytes(b"x" * 50)  # not read again: the published file was verified
    assert gguf_path(source, cache_dir=tmp_path / "cache", progress=False) == path
    assert path.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in path.parent.iterdir()) == [".tiny.gguf.lock", "tiny.gguf"]  # no partial file


def test_gguf_with_a_wrong_hash_leaves_nothing(tmp_path: Path) -> None:
    source = make_source(tmp_path, [b"GGUF" + b"a" * 10, b"b" * 5], sha256="0" * 64)
    with pytest.raises(WeightIntegrityError, match="SHA-256 mismatch"):
        gguf_path(source, cache_dir=tmp_path / "cache", progress=False)
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == [".tiny.gguf.lock"]


def test_gguf_of_a_local_checkpoint_is_refused(smollm2_dir: Path) -> None:
    with pytest.raises(NoGGUFError, match="local checkpoint"):
        gguf_path(str(smollm2_dir))


# ---------------------------------------------------------------------- with llama-cpp-python installed
def test_llama_cpp_greedy_speculation_on_smollm2(smollm2_dir: Path) -> None:
    """SmolLM2's GGUF as target and as its own draft model: every greedy draft is the target's own choice, so
    rounds carry several tokens, and the greedy outputs of all three modes agree."""
    pytest.importorskip("llama_cpp")
    from cluster.bench.llamacpp import LlamaCppPeer, LlamaCppSettings

    gguf = gguf_path("smollm2-135m")
    assert gguf.suffix == ".gguf" and gguf.is_file()  # a single-file package: used in place
    peer = LlamaCppPeer(LlamaCppSettings(model_gguf=gguf, draft_gguf=gguf, threads=1, n_ctx=256, draft_tokens=4,
                                         lookup_tokens=10, lookup=True))  # no EOS: max_tokens stops every run
    assert peer.modes() == ["plain", "draft_model", "prompt_lookup"]
    prompt = peer.plain.tokenize(b"Count from one to twenty: one, two, three, four,")
    runs = {m: peer.run(m, "p", "copy-edit", prompt, 24) for m in peer.modes()}
    assert len(runs["plain"].token_ids) == 24 and runs["plain"].text
    assert runs["draft_model"].token_ids == runs["plain"].token_ids
    assert runs["prompt_lookup"].token_ids == runs["plain"].token_ids
    assert 24 / runs["draft_model"].draft_calls > 2  # ~k + 1 tokens a round when the draft is the target
    again = peer.run("plain", "p", "copy-edit", prompt, 24, warmup=True)  # fresh KV: the same tokens
    assert again.token_ids == runs["plain"].token_ids and len(peer.runs) == 3
    result = peer.report()
    assert all(m["tokens_per_second"] > 0 for m in result["modes"])
    assert result["prompts"][0]["spec_text_equals_plain"] == {"draft_model": True, "prompt_lookup": True}


def test_bench_spec_quick_with_llamacpp(smollm2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("llama_cpp")
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--quick", "--llamacpp", "--llamacpp-python", "--no-hf", "--categories", "qa",
                 "copy-edit",
                 "--ks", "2", "--max-tokens", "8", "--threads", "1", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    section = result["llamacpp"]
    assert [m["mode"] for m in section["modes"]] == ["plain", "prompt_lookup"]  # --quick: n-gram drafts only
    for mode in section["modes"]:
        assert set(mode["by_category"]) == {"qa", "copy-edit"} and mode["tokens_per_second"] > 0
    assert [p["id"] for p in section["prompts"]] == [p["id"] for p in result["prompts"]]
    assert section["settings"]["model_gguf"].endswith(".gguf") and section["settings"]["threads"] == 1
    assert 0.0 <= section["modes"][0]["same_tokens_as_our_plain"] <= 1.0
    printed = capsys.readouterr().out
    assert "llama.cpp" in printed and "prompt_lookup =plain" in printed


def test_llama_cpp_runs_in_its_own_process_with_passive_openmp(smollm2_dir: Path) -> None:
    """The child serves the peer's calls and gets OMP_WAIT_POLICY=PASSIVE; this process's environment is left as
    it was (our engine keeps the default policy: PASSIVE slowed it by ~40%)."""
    pytest.importorskip("llama_cpp")
    from cluster.bench.llamacpp import LlamaCppSettings
    from cluster.bench.llamacpp_process import LlamaCppProcess

    before = os.environ.get("OMP_WAIT_POLICY")
    gguf = gguf_path("smollm2-135m")
    peer = LlamaCppProcess(LlamaCppSettings(model_gguf=gguf, draft_gguf=None, threads=1, n_ctx=128, draft_tokens=4,
                                            lookup_tokens=10, lookup=False))
    try:
        assert os.environ.get("OMP_WAIT_POLICY") == before
        assert peer.modes() == ["plain"]
        run = peer.run("plain", "p", "qa", [1, 504, 3458, 282], 6)
        assert len(run.token_ids) == 6 and run.seconds > 0
        assert peer.report()["settings"]["omp_wait_policy"].startswith("PASSIVE")
    finally:
        peer.close()


# ---------------------------------------------------------------------- with native llama.cpp built
needs_native = pytest.mark.skipif(not (default_bin_dir() / "llama-server").exists(),
                                  reason="native llama.cpp not built (scripts/build-llamacpp.sh; not in CI)")


@pytest.mark.ray  # starts servers: run inside scripts/in-netns.sh
@needs_native
def test_native_llama_cpp_greedy_speculation_on_smollm2(smollm2_dir: Path, tmp_path: Path) -> None:
    """llama-server on SmolLM2's GGUF, plain and with itself as the draft model: the same greedy tokens, drafts
    proposed and accepted, and the JSON names the binaries, the build and the CPU."""
    from cluster.bench.llamacpp import LlamaCppSettings
    from cluster.bench.llamacpp_native import NativeLlamaCpp

    gguf = gguf_path("smollm2-135m")
    peer = NativeLlamaCpp(LlamaCppSettings(model_gguf=gguf, draft_gguf=gguf, threads=1, n_ctx=256, draft_tokens=4,
                                           lookup_tokens=10, lookup=False), log_dir=tmp_path)
    try:
        assert peer.modes() == ["plain", "draft_model"]
        prompt = [1, 504, 3458, 282, 4649, 314, 5248, 30]
        runs = {m: peer.run(m, "p", "qa", prompt, 16) for m in peer.modes()}
        assert len(runs["plain"].token_ids) == 16 and runs["plain"].text
        assert runs["draft_model"].token_ids == runs["plain"].token_ids
        report = peer.report()
        spec = next(m for m in report["modes"] if m["mode"] == "draft_model")
        assert spec["drafted_tokens"] > 0 and spec["acceptance_rate"] > 0.5  # the draft is the target
        assert report["native"] and "llama-server" in report["settings"]["binaries"]["plain"][0]
        assert report["settings"]["cpu"] and report["build"]
    finally:
        peer.close()


def test_the_bench_prefers_llamacpp_without_amx_kernels_on_an_amx_cpu(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Native llama.cpp's AMX kernels crash in prompt processing on AMX CPUs (llama.cpp#20824): the build without
    them (LLAMACPP_AMX=OFF) comes first there when it exists; elsewhere the native build does."""
    import cluster.bench.llamacpp_native as native

    monkeypatch.delenv("SPECSERVE_LLAMACPP_BIN", raising=False)
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    root = tmp_path / "llamacpp"

    def build(name: str) -> Path:
        folder = root / f"{native.VERSION}-{name}" / "build" / "bin"
        folder.mkdir(parents=True)
        (folder / "llama-server").touch()
        return folder

    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "amx_int8"}))
    assert native.default_bin_dir() == root / f"{native.VERSION}-native-ON" / "build" / "bin"  # nothing built yet
    with_amx = build("native-ON")
    assert native.default_bin_dir() == with_amx
    without_amx = build("native-ON-noamx")
    assert native.default_bin_dir() == without_amx
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert native.default_bin_dir() == with_amx
