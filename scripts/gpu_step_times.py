"""Step times of our runtime on a CUDA device: the bundled models, or random weights of their shapes.

    python3 scripts/gpu_step_times.py MODEL_DIR [MODEL_DIR ...] --out step-times.json [--profile [--skip-times]]

Each MODEL_DIR is a checkpoint (a prepared cache entry: its own weights are timed) or holds a model's config.json
alone (random weights of that shape are made: a GPU machine that cannot fetch the bundled GGUF files still measures
their shapes; the same shapes run the same kernels). Per model, bf16 on cuda:0: a decode step (1 new token) and
verifies of 2, 3, 5, 9, 17 new tokens after a context of 128 and 1024 tokens, one sequence and a batch of 8,
medians of 10 timed calls after 3 warm-ups (torch.cuda.synchronize around each call). scripts/gpu-check.sh runs it
on the prepared models.
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

from model_runtime.local_alloc import LocalAllocator, LocalSequence  # noqa: E402
from model_runtime.model import CausalLM  # noqa: E402

BLOCK = 16
NEW_TOKENS = (1, 2, 3, 5, 9, 17)
CONTEXTS = (128, 1024)
BATCHES = (1, 8)


def random_checkpoint(config_dir: Path, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(model: CausalLM, context: int, batch: int, new: int) -> float:
    blocks = batch * ((context + 32) // BLOCK + 2)
    alloc, kv = LocalAllocator(num_blocks=blocks, block_size=BLOCK), model.allocate_kv(blocks, BLOCK)
    seqs = [LocalSequence() for _ in range(batch)]
    for seq in seqs:  # the context, one prefill per sequence
        model.forward_seqs([alloc.extend(seq, [10 + i % 1000 for i in range(context)], "last")], kv)
    step = [alloc.extend(seq, list(range(200, 200 + new))) for seq in seqs]
    samples = sorted(timed(lambda: model.forward_seqs(step, kv)) for _ in range(13))[3:]
    return samples[len(samples) // 2]


def profile(model: CausalLM, context: int = 128, steps: int = 5, top: int = 25) -> dict[str, object]:
    """Where a decode step's time goes (torch.profiler over `steps` one-token steps, batch 1): the ops with the most
    host time, with their call counts and device time, and the host-device synchronizations per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    blocks = (context + 32) // BLOCK + 2 + steps
    alloc, kv = LocalAllocator(num_blocks=blocks, block_size=BLOCK), model.allocate_kv(blocks, BLOCK)
    seq = LocalSequence()
    model.forward_seqs([alloc.extend(seq, [10 + i % 1000 for i in range(context)], "last")], kv)
    model.forward_seqs([alloc.extend(seq, [200])], kv)  # warm-up
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for i in range(steps):
            model.forward_seqs([alloc.extend(seq, [201 + i])], kv)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - started) / steps
    events = prof.key_averages()

    def device_us(e: object) -> float:
        return float(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)))

    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                       "aten::_local_scalar_dense", "cudaMemcpyAsync"))
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    return {"context": context, "steps": steps, "wall_ms_per_step_profiled": round(wall * 1e3, 3),
            "kernel_launches_per_step": launches / steps, "syncs_and_copies_per_step": syncs / steps,
            "device_ms_per_step": round(sum(device_us(e) for e in events if e.device_type.name == "CUDA") / steps / 1e3, 3),
            "top_host_ops": [{"op": e.key, "calls_per_step": e.count / steps,
                              "self_host_ms_per_step": round(e.self_cpu_time_total / steps / 1e3, 3),
                              "device_ms_per_step": round(device_us(e) / steps / 1e3, 3)} for e in rows]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("step-times.json"))
    parser.add_argument("--profile", action="store_true",
                        help="also profile decode steps (torch.profiler): host time per op, launches, syncs")
    parser.add_argument("--skip-times", action="store_true", help="with --profile: the profile alone")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    results = []
    profiles: dict[str, object] = {}
    for model_dir in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            random = not any(model_dir.glob("*.safetensors"))
            checkpoint = random_checkpoint(model_dir, Path(tmp)) if random else model_dir
            model = CausalLM.load(checkpoint, device="cuda:0", dtype=torch.bfloat16)
            print(f"{model_dir.name}: loaded in {time.perf_counter() - started:.0f} s"
                  + (" (random weights)" if random else ""), file=sys.stderr, flush=True)
            if args.profile:
                profiles[model_dir.name] = profile(model)
                print(json.dumps({model_dir.name: profiles[model_dir.name]}), flush=True)
            for context in CONTEXTS if not args.skip_times else ():
                for batch in BATCHES:
                    one = None
                    for new in NEW_TOKENS:
                        ms = 1e3 * measure(model, context, batch, new)
                        one = one or ms
                        results.append({"model": model_dir.name, "random_weights": random, "context": context, "batch": batch,
                                        "new_tokens": new, "median_ms": round(ms, 3), "x_one": round(ms / one, 3)})
                        print(json.dumps(results[-1]), flush=True)
            del model
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                    "dtype": "bfloat16",
                                    "steps": results, **({"profiles": profiles} if profiles else {})},
                                   indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
