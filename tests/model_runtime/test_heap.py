"""Reused heap pages for large activations (model_runtime/heap.py): after importing the package, a 10 MB tensor
allocated, written and freed again and again faults its pages in once, not at every allocation."""

from __future__ import annotations

import os
import subprocess
import sys

from model_runtime import heap, huge_pages

PROBE = """
import resource, sys
if sys.argv[1] == "1":
    import model_runtime
import torch

def faults_of_one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(10_000_000 // 4)  # a 16-row verify's logits of a 151,936-id vocabulary, about
    x.fill_(1.0)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_one_round()
faults_of_one_round()  # the heap grows to hold it over the first rounds
print(sum(faults_of_one_round() for _ in range(5)))
"""


def faults(with_package: bool) -> int:
    env = {**os.environ, huge_pages.ENV: "1"}  # the package's setting, in both
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if with_package else "0"], env=env, capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[-1])


def test_the_package_keeps_large_allocations_on_the_heap() -> None:
    assert heap.keep_large_allocations().startswith("mmap threshold 32 MiB")
    assert "mmap threshold" in heap.describe()
    # five more rounds: glibc's defaults map (and zero) 10 MB afresh each round, at least a fault per 2 MB page;
    # with the package's thresholds the same heap pages come back
    assert faults(with_package=False) >= 5 * 4
    assert faults(with_package=True) < 5 * 4
