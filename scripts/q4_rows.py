"""Which amx kernel a q4 call of N rows should take: the vector kernel, the block tiles or the digit planes (all give
the same bits; model_runtime/kernels/quant_amx.h). Needs a CPU with AMX and the Qwen2.5-Coder-1.5B q4 checkpoint
(`specserve models prepare qwen2.5-coder-1.5b`).

    .venv/bin/python scripts/q4_rows.py linears --bits 4 --rows 2,8,16 [--kernels vec,blocks,planes]
        every Q4_K (or Q6_K) linear of the model once per repeat (the weights streamed from memory as in a decode
        step), each kernel forced for every call; ms per pass and the ratio to the vector kernel's 1-row pass
    .venv/bin/python scripts/q4_rows.py forward --rows 1,8,16 [--repeats 7]
        the model's forward scoring N tokens after a 128-token context, the earlier thresholds (Q4_K and Q6_K on the
        planes from 9 / 48 rows, the vector kernel below) against the current ones, alternating in one process;
        the median ratio to each one's 1-row forward

Figures: docs/forward.md, "q4 verify rows on AMX block tiles".
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from model_runtime import kernel_registry, q4_tiles

CHECKPOINT = "qwen2.5-coder-1.5b"
EARLIER = ((9, 48), (9, 48))  # (min rows, plane rows) before the block tiles: planes from 9 / 48 rows
FORCED = {"vec": ((1 << 30, 1 << 30), (1 << 30, 1 << 30)), "blocks": ((1, 1), (1 << 30, 1 << 30)),
          "planes": ((1, 1), (1, 1))}


def set_kernels(module: object, thresholds: tuple[tuple[int, int], tuple[int, int]]) -> None:
    module.set_amx_min_rows(*thresholds[0])  # type: ignore[attr-defined]
    module.set_amx_plane_rows(*thresholds[1])  # type: ignore[attr-defined]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def linears(module: object, bits: int, rows: list[int], kernels: list[str], repeats: int) -> None:
    from safetensors import safe_open

    from model_runtime.prepare import prepare_model

    path = prepare_model(CHECKPOINT) / "quant-v3.safetensors"
    with safe_open(str(path), "pt") as f:
        layout = json.loads(f.metadata()["layout"])
        parts = [(f.get_tensor(p["tensor"]), p) for ps in layout.values() for p in ps if p["bits"] == bits]
    outs: dict[tuple[int, int], torch.Tensor] = {}

    def one_pass(m: int) -> float:
        total = 0.0
        for w, p in parts:
            x = torch.randn(m, p["k"])
            out = outs.setdefault((m, p["n"]), torch.empty(m, p["n"]))
            start = time.perf_counter()
            module.quant_linear_into(x, w, p["n"], p["bits"], p["superblock"], p["block"], out, 0)  # type: ignore[attr-defined]
            total += time.perf_counter() - start
        return total * 1e3

    set_kernels(module, FORCED["vec"])
    one_pass(1)
    one = median([one_pass(1) for _ in range(repeats)])
    print(f"{len(parts)} linears of {bits}-bit codes: the vector kernel's 1-row pass {one:.1f} ms", flush=True)
    for m in rows:
        line = []
        for kernel in kernels:
            set_kernels(module, FORCED[kernel])
            ms = median([one_pass(m) for _ in range(repeats)])
            line.append(f"{kernel} {ms:7.1f} ms ({ms / one:.2f}x)")
        print(f"{m:3d} rows: " + "   ".join(line), flush=True)


def forward(module: object, rows: list[int], repeats: int) -> None:
    from cluster.bench import runtime
    from model_runtime.prepare import prepare_model

    checkpoint = prepare_model(CHECKPOINT)
    model = runtime.CausalLM.load(checkpoint, dtype=runtime.target_dtype("q4", "cpu", checkpoint))
    gen = torch.Generator().manual_seed(0)
    context, bs, vocab = 128, runtime.BLOCK_SIZE, model.config.vocab_size
    blocks = -(-(context + max(rows)) // bs) + 1
    alloc, kv, seq = runtime.LocalAllocator(blocks, bs), model.allocate_kv(blocks, bs), runtime.LocalSequence()
    model.forward_seqs([alloc.extend(seq, torch.randint(vocab, (context,), generator=gen).tolist(), "last")], kv)
    new = torch.randint(vocab, (max(rows),), generator=gen).tolist()
    steps = {}
    for n in sorted({1, *rows}):
        steps[n] = alloc.extend(seq, new[:n])
        seq.length = context
    configs = {"earlier": EARLIER, "current": (q4_tiles.amx_min_rows(), q4_tiles.AMX_PLANE_ROWS)}
    ms: dict[str, dict[int, list[float]]] = {c: {n: [] for n in steps} for c in configs}
    def timed(n: int) -> float:
        start = time.perf_counter()
        model.forward_seqs([steps[n]], kv)
        return (time.perf_counter() - start) * 1e3

    for rep in range(repeats):
        for name, thresholds in configs.items():
            set_kernels(module, thresholds)
            timed(1)
            for n in steps:
                ms[name][n].append(timed(n))
        print(f"repeat {rep + 1}/{repeats}", flush=True)
    for name in configs:
        one = ms[name][1]
        ratios = " ".join(f"{n}: {median([a / b for a, b in zip(ms[name][n], one, strict=True)]):.2f}x"
                          for n in steps if n > 1)
        print(f"{name:8s} 1 row {median(one):.1f} ms; {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["linears", "forward"])
    parser.add_argument("--bits", type=int, choices=[4, 6], default=4, help="linears: Q4_K (4) or Q6_K (6)")
    parser.add_argument("--rows", default="2,8,16", help="comma-separated row counts")
    parser.add_argument("--kernels", default="vec,blocks,planes", help="linears: of vec, blocks, planes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    build = kernel_registry.build_of("amx", kernel_registry.Q4_LINEAR)
    module = kernel_registry.module(build)
    if module is None:
        raise SystemExit(f"the amx kernels do not run here: {kernel_registry.status(build)}")
    rows = [int(r) for r in args.rows.split(",")]
    with torch.inference_mode():
        if args.what == "linears":
            linears(module, args.bits, rows, args.kernels.split(","), args.repeats)
        else:
            forward(module, rows, args.repeats)
    set_kernels(module, (q4_tiles.amx_min_rows(), q4_tiles.AMX_PLANE_ROWS))


if __name__ == "__main__":
    main()
