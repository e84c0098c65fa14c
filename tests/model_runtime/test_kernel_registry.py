"""The kernel registry (model_runtime/kernel_registry.py): the table is whole (every row's sources and headers exist,
every header a build includes is hashed into its flags, the fallbacks end at torch), the C++ includes form no circle,
each op and helper has one source, the forward's modules name no path, and a capped path resolves every op below it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from model_runtime import kernel_registry as registry
from model_runtime.kernel_build import FLAGS_OFF, cpu_flags

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "model_runtime" / "kernels"
INCLUDE = re.compile(r'^\s*#include "([^"]+)"', re.M)
PATH_NAMES = re.compile(r"amx|avx512|avx2vnni|avx2|onednn", re.I)


def includes(name: str) -> list[str]:
    return INCLUDE.findall((KERNELS / name).read_text())


def closure(sources: tuple[str, ...]) -> set[str]:
    """Every header the sources include, directly or through another header."""
    seen: set[str] = set()
    todo = [h for s in sources for h in includes(s)]
    while todo:
        header = todo.pop()
        if header not in seen:
            seen.add(header)
            todo.extend(includes(header))
    return seen


def test_every_row_is_whole_and_the_chain_ends_at_torch() -> None:
    for path in registry.PATHS:
        names = [p.name for p in registry.chain(path.name)]
        assert names[0] == path.name and names[-1] == "torch" and len(set(names)) == len(names), names
        for build in path.builds:
            for f in (*build.sources, *build.headers):
                assert (KERNELS / f).is_file(), (build.name, f)
            assert closure(build.sources) <= set(build.headers), (build.name, closure(build.sources) - set(build.headers))
            assert build.needs, build.name
            assert set(build.ops) <= set(registry.OPS), build.name
    provided = {op for p in registry.PATHS for op in p.ops}
    assert provided == set(registry.OPS)
    assert registry.requested() in (*registry.BY_NAME, "auto")


def test_every_source_file_is_in_the_table() -> None:
    """A kernels/ file no build compiles or hashes would be dead, or stale in the builds that include it."""
    listed = {f for p in registry.PATHS for b in p.builds for f in (*b.sources, *b.headers)}
    assert {f.name for f in KERNELS.iterdir() if f.suffix in (".cpp", ".h")} == listed


def test_the_includes_form_no_circle_and_headers_stand_alone() -> None:
    """No file includes a .cpp, every header is `#pragma once` and includes what it uses before any code (never
    inside a namespace), and the include graph has no cycle."""
    files = {f.name: f.read_text() for f in KERNELS.iterdir() if f.suffix in (".cpp", ".h")}
    for name, text in files.items():
        for header in INCLUDE.findall(text):
            assert header.endswith(".h") and header in files, (name, header)
        first_code = re.search(r"^(namespace|struct|inline|template|typedef|constexpr|void|bool)\b", text, re.M)
        last_include = max((m.end() for m in INCLUDE.finditer(text)), default=0)
        assert first_code is None or last_include < first_code.start(), f"{name} includes after its code begins"
        if name.endswith(".h"):
            assert "#pragma once" in text, name

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, " -> ".join((*stack, name))
        for header in INCLUDE.findall(files[name]):
            visit(header, (*stack, name))

    for name in files:
        visit(name, ())


@pytest.mark.parametrize(("what", "pattern"), [
    ("exp", r"inline \w+ v?exp\w*\("), ("amx_enable", r"bool amx_enable\(\)"),
    ("RMSNorm", r"torch::Tensor rms_norm\([^;]*\{"), ("silu_mul", r"torch::Tensor silu_mul\([^;]*\{"),
    ("attention", r"void paged_attention_group\([^;]*\{"), ("tile config", r"struct alignas\(64\) TileConfig"),
])
def test_each_op_and_helper_has_one_source(what: str, pattern: str) -> None:
    found = [f.name for f in KERNELS.iterdir() if f.suffix in (".cpp", ".h")
             for _ in re.finditer(pattern, f.read_text())]
    assert len(found) == 1, (what, found)


def test_the_forward_asks_the_registry_and_reads_the_flags_once() -> None:
    """model.py, attention.py and precision.py name no kernel path; one function reads /proc/cpuinfo's flags."""
    for name in ("model.py", "attention.py", "precision.py"):
        text = (ROOT / "model_runtime" / name).read_text()
        assert not PATH_NAMES.search(text), (name, PATH_NAMES.findall(text))
    py = [f for d in ("model_runtime", "cluster", "drafter_service", "verifier_service", "kv_manager", "deploy")
          for f in (ROOT / d).rglob("*.py")]
    readers = [f.name for f in py if 'startswith("flags")' in f.read_text()]
    defined = [f.name for f in py if "def cpu_flags(" in f.read_text()]
    assert readers == ["kernel_build.py"] and defined == ["kernel_build.py"], (readers, defined)


def test_a_capped_path_resolves_its_ops_from_its_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECSERVE_CPU_KERNEL=avx2 (where this CPU has AVX2): every forward op and q4 on avx2's own builds, nothing
    packed; with avx2 hidden by SPECSERVE_CPU_FLAGS_OFF too, the path is refused."""
    if not registry.cpu_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "avx2")
    assert registry.active() == "avx2"
    for op in (*registry.ROW_OPS, registry.LINEAR, registry.Q4_LINEAR):
        found = registry.resolve(op)
        assert found is not None and found[0] == "avx2" and found[1].isa() == "avx2", op
    assert registry.resolve(registry.PACKED_LINEAR) is None and not registry.may_run(registry.PACKED_LINEAR)
    cpu_flags.cache_clear()
    monkeypatch.setenv(FLAGS_OFF, "avx2")
    try:
        assert "avx2" not in registry.available() and registry.resolve(registry.LINEAR) is None
        with pytest.raises(ValueError, match="cannot run it"):
            registry.active()
    finally:
        monkeypatch.delenv(FLAGS_OFF)
        cpu_flags.cache_clear()


def test_auto_takes_the_fastest_path_that_runs_and_torch_resolves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSERVE_CPU_KERNEL", raising=False)
    first = registry.active()
    assert first in registry.available()
    assert all(registry._why_not(p) is not None for p in registry.PATHS[:[p.name for p in registry.PATHS].index(first)])
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "onednn")  # the old name of torch's path
    assert registry.active() == "torch"
    assert all(registry.resolve(op) is None for op in registry.OPS)
