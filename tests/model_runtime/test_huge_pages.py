"""Huge pages for the weights (model_runtime/huge_pages.py): importing the package asks torch's allocator for them
before any weight is allocated, an explicit setting is kept, and a large tensor then lands on huge pages wherever
the kernel's THP mode allows it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_runtime import huge_pages


def test_enable_sets_the_allocator_flag_unless_the_environment_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    huge_pages.enable()
    assert os.environ[huge_pages.ENV] == "1"
    monkeypatch.setenv(huge_pages.ENV, "0")
    huge_pages.enable()
    assert os.environ[huge_pages.ENV] == "0"
    assert "off" in huge_pages.describe()


def test_system_setting_reads_the_bracketed_mode(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert huge_pages.system_setting(setting) == "madvise"
    setting.write_text("[never]\n")
    assert huge_pages.system_setting(setting) == "never"
    assert huge_pages.system_setting(tmp_path / "missing") is None


PROBE = """
import model_runtime, torch
x = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, as a weight would be allocated
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("AnonHugePages"):
        print(line.split()[1])
"""


NO_THP = huge_pages.system_setting() not in ("always", "madvise") or not Path("/proc/self/smaps_rollup").exists()


@pytest.mark.skipif(NO_THP, reason="the kernel offers no transparent huge pages here")
def test_a_large_tensor_lands_on_huge_pages_after_importing_the_package() -> None:
    env = {k: v for k, v in os.environ.items() if k != huge_pages.ENV}
    kib = int(subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                             check=True).stdout.split()[-1])
    assert kib >= 2048, f"{kib} KiB of huge pages for a 64 MiB tensor"
