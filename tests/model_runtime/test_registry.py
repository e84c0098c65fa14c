"""Registry: name resolution, installed weight packages, and the `specserve models` CLI surface."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from model_runtime.registry import (
    KNOWN_MODELS,
    MissingWeightsError,
    ModelSource,
    PackageFile,
    PackageParts,
    UnknownModelError,
    resolve_model,
)
from specserve_types.api import SpecServeError

EXPECTED_NAMES = ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"]


def test_known_models_are_the_three_from_the_architecture() -> None:
    assert list(KNOWN_MODELS) == EXPECTED_NAMES
    assert [source.role for source in KNOWN_MODELS.values()] == ["target", "draft", "test"]
    assert all(name == source.name for name, source in KNOWN_MODELS.items())


def test_unknown_name_error_lists_every_known_name() -> None:
    with pytest.raises(UnknownModelError) as caught:
        resolve_model("llama-70b")
    assert isinstance(caught.value, SpecServeError)
    message = str(caught.value)
    assert "'llama-70b'" in message
    for name in EXPECTED_NAMES:
        assert name in message


def test_known_name_resolves_to_its_source() -> None:
    source = resolve_model("smollm2-135m")
    assert isinstance(source, ModelSource)
    assert source.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_local_checkpoint_dir_resolves_to_its_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="no config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_installed_parts_add_up_to_the_registered_size(name: str) -> None:
    source = KNOWN_MODELS[name]
    parts = source.parts.paths()
    assert sum(part.stat().st_size for part in parts) == source.size_bytes
    if isinstance(source.parts, PackageParts):
        assert len(parts) == source.parts.count
        assert [part.name for part in parts] == [f"part{i:02d}.bin" for i in range(1, len(parts) + 1)]


def test_missing_weight_package_names_the_package_and_the_fix() -> None:
    with pytest.raises(MissingWeightsError, match=r"no-such-weights-part1==1\.0.*requirements-weights"):
        PackageParts("no-such-weights-part", "1.0", 2).paths()
    with pytest.raises(MissingWeightsError, match="no-such-weights==1.0"):
        PackageFile("no-such-weights", "1.0", "no_such_weights", "*.gguf").paths()


def test_cli_list_shows_every_model_and_cache_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in EXPECTED_NAMES:
        assert f"no (run: specserve models prepare {name})" in out
    assert f"cache: {tmp_path}" in out


@pytest.mark.parametrize("amx", [True, False])
def test_cli_list_says_what_auto_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    """RUNS AS: q4 for every known model where the AMX kernels do not run (model_runtime/precision.py), prepared
    or not; with them, a target q4 alone and bfloat16 batched, the draft int8."""
    from model_runtime import precision, quant_kernels

    if quant_kernels.active() is None:
        pytest.skip(quant_kernels.describe())
    monkeypatch.setattr(precision, "cpu_packs_bf16", lambda: amx)
    monkeypatch.setattr(precision, "cpu_packs_int8", lambda: amx)
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    start, end = header.index("RUNS AS"), header.index("--dtype q4")
    rows = {line.split()[0]: line[start:end].strip() for line in lines if not line.startswith("cache:")}
    if amx:  # a target runs its GGUF's codes alone (max_batch 1), bfloat16 when batching; the draft int8
        assert rows == {"qwen2.5-coder-1.5b": "q4 alone, bfloat16 batched", "qwen2.5-coder-0.5b": "int8",
                        "smollm2-135m": "q4 alone, bfloat16 batched"}, rows
    else:
        assert {rows[name] for name in EXPECTED_NAMES} == {"q4"}, rows


def test_cli_unknown_name_is_one_line_error_exit_2_and_prepares_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["models", "prepare", "smollm2-135m", "nope", "--cache-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown model 'nope'")
    assert all(name in lines[0] for name in EXPECTED_NAMES)
    assert list(tmp_path.iterdir()) == []  # names are checked before any work starts
