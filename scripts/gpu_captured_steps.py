"""The captured step (model_runtime/graph/) on a CUDA device: capture, step times, profile, greedy, and the peer.

    python3 scripts/gpu_captured_steps.py MODEL_DIR [MODEL_DIR ...] --out captured.json
        [--mode cuda-graph|compile+cuda-graph|reduce-overhead] [--budget-s 400] [--device cuda] [--quick]

MODEL_DIRs as scripts/gpu_step_times.py takes them (a checkpoint, or a config.json alone: random bf16 weights of
that shape). Per model, in this order, each part skipped with the reason once the budget is spent:

  capture     every bucket (batch 1 and 8 x rows 1, 2, 3, 5, 9, 17 x contexts of 128 and 1024 tokens) of the
              verify program, and the draft's greedy chain of 4 on its one-row buckets: seconds, device memory
  steps       a step through the captured program (staging, one copy, replay, the verdict's one read) after 128
              and 1024 tokens, batch 1 and 8, 1..17 rows; the eager forward on the same step beside it
  profile     five captured decode steps (batch 1, 128 tokens): kernel and graph launches, syncs and copies
  greedy      32 tokens plain (captured decode) against speculative (the draft's chain of 4 in one program, the
              verdict on the device; the draft: the same weights, a runner and pool of its own) and the eager
              forward's plain decoding: whether the tokens are equal, where they first differ
  peer        transformers' generate with its static cache (compiled by generate itself on CUDA: fullgraph,
              reduce-overhead), greedy, 128 new tokens after 128, batch 1: ms per token

--device cpu --quick: the same parts on the CPU in eager mode with one context, fewer rows, 16 peer tokens (a check
that the script runs: tests/scripts/test_gpu_captured_steps.py); the figures mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_step_times import random_checkpoint  # noqa: E402

from model_runtime.graph.buckets import Bucket, Buckets  # noqa: E402
from model_runtime.graph.local_loop import plain_greedy, speculative_greedy  # noqa: E402
from model_runtime.graph.runner import CapturedRunner  # noqa: E402
from model_runtime.local_alloc import LocalAllocator, LocalSequence  # noqa: E402
from model_runtime.model import CausalLM  # noqa: E402

BLOCK = 16
K = 4
GREEDY_TOKENS = 32
PEER_TOKENS = 128


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, calls: int = 10, warm: int = 3) -> float:
    samples = []
    for i in range(warm + calls):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        if i >= warm:
            samples.append((time.perf_counter() - started) * 1e3)
    return round(sorted(samples)[len(samples) // 2], 3)


def shapes(quick: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(contexts, batches, rows)."""
    return ((128,), (1, 2), (1, 3)) if quick else ((128, 1024), (1, 8), (1, 2, 3, 5, 9, 17))


def make_runner(model: CausalLM, mode: str, quick: bool) -> tuple[CapturedRunner, dict[str, object]]:
    contexts, batches, rows = shapes(quick)
    blocks = tuple(-(-c // BLOCK) for c in contexts)
    num_blocks = max(batches) * (-(-(max(contexts) + max(rows) + K) // BLOCK) + 1)
    runner = CapturedRunner(model, num_blocks, BLOCK, Buckets(batches, rows, blocks), mode=mode, chain=K)  # type: ignore[arg-type]
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    report = runner.warm_up(draft=[Bucket(b, 1, n) for b in batches for n in blocks])
    out = {name: {"buckets": len(r.seconds), "seconds": round(sum(r.seconds.values()), 3),
                  "slowest_bucket_s": round(max(r.seconds.values()), 3), "memory_mib": round(r.memory_bytes / 2**20, 1)}
           for name, r in report.items()}
    if cuda:
        out["peak_allocated_mib"] = round(torch.cuda.max_memory_allocated(model.device) / 2**20, 1)
    return runner, out


def step_times(runner: CapturedRunner, quick: bool) -> list[dict[str, object]]:
    contexts, batches, rows = shapes(quick)
    device, results = runner.model.device, []
    for context in contexts:
        for batch in batches:
            alloc = LocalAllocator(runner.kv.num_blocks - runner.scratch.count // BLOCK, BLOCK)
            seqs = [LocalSequence() for _ in range(batch)]
            for seq in seqs:  # the context: one eager prefill per sequence
                runner.forward_seqs([alloc.extend(seq, [10 + i % 1000 for i in range(context)], "last")])
            one = None
            for new in rows:
                step = [alloc.extend(seq, list(range(200, 200 + new))) for seq in seqs]
                captured = median_ms(lambda: runner.verify_greedy(step, [new - 1] * batch), device)  # noqa: B023
                eager = median_ms(lambda: runner.model.forward_seqs(step, runner.kv), device)  # noqa: B023
                for seq in seqs:
                    seq.length -= new
                one = one or captured
                results.append({"context": context, "batch": batch, "rows": new, "captured_ms": captured,
                                "x_one": round(captured / one, 3), "eager_ms": eager})
                print(json.dumps(results[-1]), flush=True)
    return results


def profile(runner: CapturedRunner, steps: int = 5) -> dict[str, object]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = runner.model.device
    alloc, seq = LocalAllocator(runner.kv.num_blocks - runner.scratch.count // BLOCK, BLOCK), LocalSequence()
    runner.forward_seqs([alloc.extend(seq, [10 + i for i in range(128)], "last")])
    runner.verify_greedy([alloc.extend(seq, [200])], [0])  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with torch_profile(activities=activities) as prof:
        started = time.perf_counter()
        for i in range(steps):
            runner.verify_greedy([alloc.extend(seq, [201 + i])], [0])
        sync(device)
        wall = (time.perf_counter() - started) / steps
    events = prof.key_averages()

    def count(keys: tuple[str, ...]) -> float:
        return sum(e.count for e in events if e.key in keys) / steps

    return {"wall_ms_per_step_profiled": round(wall * 1e3, 3),
            "kernel_launches_per_step": count(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")),
            "graph_launches_per_step": count(("cudaGraphLaunch",)),
            "syncs_and_copies_per_step": count(("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                "cudaEventSynchronize", "aten::_local_scalar_dense",
                                                "cudaMemcpyAsync"))}


def greedy(model: CausalLM, runner: CapturedRunner, mode: str, quick: bool) -> dict[str, object]:
    prompt = [10 + (7 * i) % min(997, model.config.vocab_size - 10) for i in range(40)]
    num_blocks = runner.kv.num_blocks - runner.scratch.count // BLOCK
    draft = CapturedRunner(model, num_blocks, BLOCK, Buckets((1,), (1, 2), runner.buckets.blocks), mode=mode,  # type: ignore[arg-type]
                           chain=K)
    draft.warm_up(verify=[])
    eager_kv = model.allocate_kv(num_blocks, BLOCK)
    plain = plain_greedy(runner.forward_seqs, prompt, GREEDY_TOKENS, num_blocks, BLOCK)
    eager = plain_greedy(lambda seqs: model.forward_seqs(seqs, eager_kv), prompt, GREEDY_TOKENS, num_blocks, BLOCK)
    spec, accepted = speculative_greedy(runner, draft, prompt, GREEDY_TOKENS, num_blocks)

    def first_difference(a: list[int], b: list[int]) -> int | None:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)

    return {"tokens": GREEDY_TOKENS, "speculative_equals_plain": spec == plain,
            "first_difference": first_difference(spec, plain), "captured_plain_equals_eager": plain == eager,
            "first_difference_eager": first_difference(plain, eager), "accepted_per_round": accepted}


def peer(checkpoint: Path, device: torch.device, new_tokens: int, batch: int = 1) -> dict[str, object]:
    """transformers' generate, static cache (compiled by generate on CUDA), greedy: ms per new token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16 if device.type == "cuda"
                                              else torch.float32).to(device)
    ids = torch.randint(10, min(1000, hf.config.vocab_size), (batch, 128), device=device)

    def generate() -> object:
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")

    started = time.perf_counter()
    generate()  # compiles (CUDA)
    sync(device)
    first = time.perf_counter() - started
    ms = median_ms(generate, device, calls=3, warm=1)
    return {"batch": batch, "prompt": 128, "new_tokens": new_tokens, "first_call_s": round(first, 1),
            "ms_per_token": round(ms / new_tokens, 3), "generate_ms": ms}


def measure(model_dir: Path, device: torch.device, mode: str, quick: bool, budget: Budget) -> dict[str, object]:
    """One model's parts, in order; each skipped with the reason once the budget is spent (or without a capture),
    one that fails recorded with its error (the others still run)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    entry: dict[str, object] = {"model": model_dir.name, "mode": mode, "dtype": str(dtype).removeprefix("torch.")}
    with tempfile.TemporaryDirectory() as tmp:
        random = not any(model_dir.glob("*.safetensors"))
        entry["random_weights"] = random
        checkpoint = random_checkpoint(model_dir, Path(tmp)) if random else model_dir
        model = CausalLM.load(checkpoint, device=device, dtype=dtype)
        runner: CapturedRunner | None = None

        def run_part(name: str) -> object:
            if name == "capture":
                return make_runner(model, mode, quick)
            assert runner is not None
            if name == "steps":
                return step_times(runner, quick)
            if name == "profile":
                return profile(runner)
            if name == "greedy":
                return greedy(model, runner, mode, quick)
            return peer(checkpoint, device, 16 if quick else PEER_TOKENS)

        for name in ("capture", "steps", "profile", "greedy", "peer"):
            if budget.left() <= 0 or (name != "capture" and runner is None):
                entry[name] = {"skipped": "budget spent" if budget.left() <= 0 else "no capture"}
                continue
            started = time.perf_counter()
            try:
                value = run_part(name)
            except Exception as exc:  # a part that fails on the device is recorded, the others still run
                value = {"failed": f"{type(exc).__name__}: {exc}"}
            if name == "capture" and isinstance(value, tuple):
                runner, value = value
            entry[name] = value
            print(json.dumps({"model": model_dir.name, "part": name, "seconds": round(time.perf_counter() - started, 1),
                              "result": value if name != "steps" else "above"}), flush=True)
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("captured.json"))
    parser.add_argument("--mode", default="cuda-graph", choices=("eager", "cuda-graph", "compile+cuda-graph",
                                                                  "reduce-overhead"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=400.0, help="parts past it are skipped, with the reason")
    parser.add_argument("--quick", action="store_true", help="one context, batches 1-2, rows 1 and 3")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    mode = args.mode if device.type == "cuda" else "eager"
    budget, results = Budget(args.budget_s), []
    for model_dir in args.models:
        results.append(measure(model_dir, device, mode, args.quick, budget))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda}
    args.out.write_text(json.dumps({**info, "models": results}, indent=2) + "\n")
    failed = [f"{r['model']}:{k}" for r in results for k, v in r.items() if isinstance(v, dict) and "failed" in v]
    if failed:
        print(f"failed parts: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
