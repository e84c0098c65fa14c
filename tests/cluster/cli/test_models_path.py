"""`specserve models path NAME`: stdout is exactly the prepared HF folder (usable as `--tokenizer "$(...)"`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli.main import main
from model_runtime.prepare import MANIFEST_NAME
from model_runtime.registry import KNOWN_MODELS


def test_path_prints_the_cached_entry_without_preparing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = KNOWN_MODELS["smollm2-135m"]
    entry = tmp_path / source.name
    entry.mkdir()
    (entry / MANIFEST_NAME).write_text(json.dumps({"source_sha256": source.sha256}))

    assert main(["models", "path", source.name, "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out == f"{entry}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]  # nothing built next to it


def test_path_of_a_local_checkpoint_is_that_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "my-model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")

    assert main(["models", "path", str(checkpoint)]) == 0
    assert capsys.readouterr().out == f"{checkpoint.resolve()}\n"


@pytest.mark.parametrize("name", ["no-such-model", "{tmp}"])  # an unknown name; a folder without config.json
def test_path_refuses_what_is_not_a_model(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "path", name.format(tmp=tmp_path), "--cache-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ")
