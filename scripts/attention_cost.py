"""One layer's paged attention at SmolLM2's decode shapes (9 query heads, 3 KV heads of 64), bfloat16, one thread.

    .venv/bin/python scripts/attention_cost.py [--widths 200,480,800,1600] [--rows 3] [--seqs 8] [--repeats 30]

Each sequence scores `--rows` new rows (a chain's verify) after W past keys, its slots scattered over the pool as a
running engine's are; prints the median time of one call (one layer) per width on the kernel path this process
takes (`SPECSERVE_CPU_KERNEL` picks another), with the float rate of its two products.
"""

from __future__ import annotations

import argparse
import time

import torch

from model_runtime import cpu_kernels
from model_runtime.attention import paged_attention, plan_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="200,480,800,1600")
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    kernels = cpu_kernels.for_dtype(torch.bfloat16)
    n, seqs = args.rows, args.seqs
    print(f"path {kernels.path}: {seqs} sequences x {n} rows, one thread")
    for width in (int(w) for w in args.widths.split(",")):
        slots = seqs * (width + n)
        k_flat = torch.randn(slots, KV_HEADS, HEAD_DIM).bfloat16()
        v_flat = torch.randn(slots, KV_HEADS, HEAD_DIM).bfloat16()
        q = torch.randn(seqs * n, HEADS, HEAD_DIM).bfloat16()
        order = torch.randperm(slots)
        plan = plan_attention([(i * n, order[i * (width + n):(i + 1) * (width + n)], n) for i in range(seqs)])
        times = []
        for _ in range(args.repeats + 3):
            start = time.perf_counter()
            paged_attention(q, k_flat, v_flat, plan, rows=kernels.rows)
            times.append(time.perf_counter() - start)
        median = sorted(times[3:])[args.repeats // 2]
        flops = 2 * 2 * seqs * n * HEADS * (width + n) * HEAD_DIM
        print(f"{width:6d} keys: {median * 1e3:7.3f} ms a layer, {flops / median / 1e9:5.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
