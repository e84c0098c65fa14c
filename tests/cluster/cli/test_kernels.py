"""`specserve kernels` (cluster/cli/kernels.py): the registry's table for the CPU at hand, each path once with
whether this CPU has it and its builds' state, then each op with the path and module that run it in this process
(the ones a model would take), the q4 build, huge pages and the heap; a bad SPECSERVE_CPU_KERNEL is one line, exit 2."""

from __future__ import annotations

import pytest
import torch

from cluster.cli.main import main
from model_runtime import cpu_kernels
from model_runtime import kernel_registry as registry


def test_prints_each_path_and_what_each_op_runs_on(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSERVE_CPU_KERNEL", raising=False)
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out.splitlines()
    chosen = registry.active()
    assert f"SPECSERVE_CPU_KERNEL=auto: this process runs {chosen}" in out
    rows = {line.split()[0]: line for line in out if line.startswith("  ")}
    for path in registry.PATHS:
        has = registry.cpu_has(path.name)
        assert f"cpu {'yes' if has else 'no'}" in rows[path.name], rows[path.name]
        for build in path.builds:
            assert build.name in rows[path.name]
            if has:
                assert f"{build.name} ({' '.join(build.sources)}): {registry.status(build)}" in rows[path.name]
    fp32 = cpu_kernels.for_dtype(torch.float32)
    if fp32.linear is not None:  # the op lines name the path and module a float32 model runs
        assert rows[registry.LINEAR].split()[1:] == [fp32.path, f"({fp32.linear.__name__})"]
        assert rows[registry.ATTENTION].split()[2] == f"({fp32.rows.__name__})"
    else:
        assert "none: torch ops" in rows[registry.LINEAR]
    assert any(line.startswith("quantized linears (--dtype q4):") for line in out)


def test_a_capped_path_shows_in_the_op_lines(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "torch")
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "SPECSERVE_CPU_KERNEL=torch: this process runs torch" in out
    assert "linear         none: torch ops (bounded, not exact)" in out
    assert "q4_linear      none: --dtype q4 refused" in out


def test_an_unknown_path_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "avx1024")
    assert main(["kernels"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "choose one of" in captured.err
