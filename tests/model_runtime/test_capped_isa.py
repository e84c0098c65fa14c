"""The row-invariance tests again with the libraries' instruction sets capped, as on a smaller CPU.

Our kernels must not lean on a library whose kernel choice follows the CPU: oneDNN and MKL pick other kernels (and
with them other reduction orders) when `ONEDNN_MAX_CPU_ISA` / `MKL_ENABLE_INSTRUCTIONS` cap them, as they would on
an AVX2 or AVX-512-without-AMX CPU. With AVX2 caps, the amx path's attention for keys wider than 512 (then the
float32 products through MKL) gave a row among 9 other bits than the row alone; it now takes the avx512 build.
Each cap runs, in a child process (the caps are read when the libraries load), the per-op tests on the real shapes,
and one forward's rows against their call, on every path of this CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELECTED = [
    "tests/model_runtime/test_cpu_kernels.py::test_attention_rows_alone_equal_rows_among_others",
    "tests/model_runtime/test_cpu_kernels.py::test_norm_and_activation_rows_are_batch_invariant_and_match_torch",
    "tests/model_runtime/test_cpu_kernels.py::test_a_tree_row_equals_the_chain_of_its_ancestors",
    "tests/model_runtime/test_precision.py::test_smollm2_bf16_rows_do_not_depend_on_their_call",
    "tests/model_runtime/test_cpu_kernels.py::test_linear_rows_are_batch_invariant_and_near_the_exact_product",
]
# the linears at SmolLM2's shapes (the Qwen ones run the same code, a minute more); the engine's end-to-end tests
# (minutes per cap) rest on these ops


@pytest.mark.parametrize("cap", ["AVX2", "AVX512_CORE"])
def test_rows_keep_their_bits_with_the_libraries_capped(cap: str, smollm2_dir: Path) -> None:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap, "MKL_ENABLE_INSTRUCTIONS": cap}
    env.pop("SPECSERVE_CPU_KERNEL", None)  # every path this CPU has (the tests' own parameters)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SELECTED,
           "-k", "not test_linear_rows or x576-"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    assert done.returncode == 0, f"with {cap} caps:\n{tail}"
    assert " passed" in tail and "failed" not in tail, tail
