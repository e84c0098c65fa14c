"""`specserve bench precision`: what bfloat16 costs in quality and buys in speed, against float32.

On the text the repo ships (cluster/bench/prompts/quality_text.txt: prose and Python), each dtype scores every
position in one forward (teacher forcing):

    perplexity     exp(mean NLL of the text's next tokens)          per dtype
    top-1 agree    share of positions whose argmax equals float32's
    decode ms      median one-token decode step after the text (the plain-decoding cost), and its ratio; the
                   dtypes' steps interleaved (the machine is shared: a slow spell hits both)
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cluster.bench.runtime import progress
from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from model_runtime.precision import dtype_name, target_dtype

TEXT = Path(__file__).parent / "prompts" / "quality_text.txt"


def _interleaved_decode_ms(models: dict[str, CausalLM], prompt: list[int], steps: int) -> dict[str, float]:
    """Median one-token decode step per model after `prompt`, the models' steps interleaved (one step of each in
    turn), so a slower or faster spell of the shared machine falls on every dtype alike."""
    blocks = -(-(len(prompt) + steps + 1) // 16) + 1
    state = {}
    for name, model in models.items():
        alloc, kv, seq = LocalAllocator(blocks, 16), model.allocate_kv(blocks, 16), LocalSequence()
        (logits,) = model.forward_seqs([alloc.extend(seq, prompt, logits="last")], kv)
        state[name] = (alloc, kv, seq, logits)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(steps):
        for name, model in models.items():
            alloc, kv, seq, logits = state[name]
            token = int(logits[-1].argmax())
            start = time.perf_counter()
            (logits,) = model.forward_seqs([alloc.extend(seq, [token])], kv)
            times[name].append(time.perf_counter() - start)
            state[name] = (alloc, kv, seq, logits)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def run_precision_bench(model_name: str, dtypes: list[str], decode_steps: int = 16,
                        threads: int = 2) -> dict[str, Any]:
    from cluster.engine.factory import load_tokenizer, model_dir

    torch.set_num_threads(threads)
    checkpoint = model_dir(model_name)
    ids = list(load_tokenizer(checkpoint)(TEXT.read_text(encoding="utf-8"))["input_ids"])
    targets = torch.tensor(ids[1:])
    rows: dict[str, dict[str, Any]] = {}
    argmax: dict[str, torch.Tensor] = {}
    models: dict[str, CausalLM] = {}
    for name in dtypes:
        dtype = target_dtype(name, "cpu", checkpoint)
        progress(f"precision: {model_name} in {dtype_name(dtype)}: scoring {len(ids)} tokens")
        model = CausalLM.load(checkpoint, dtype=dtype)
        blocks = -(-len(ids) // 16) + 1
        (logits,) = model.forward_seqs([LocalAllocator(blocks, 16).extend(LocalSequence(), ids)],
                                       model.allocate_kv(blocks, 16))
        logprobs = logits[:-1].double().log_softmax(-1)
        nll = -logprobs.gather(1, targets[:, None]).mean().item()
        argmax[dtype_name(dtype)] = logits[:-1].argmax(-1)
        rows[dtype_name(dtype)] = {"perplexity": math.exp(nll), "linear_kernel": model.linear_kernel}
        models[dtype_name(dtype)] = model
    progress(f"precision: {model_name}: timing {decode_steps} decode steps of each dtype, interleaved")
    for name, ms in _interleaved_decode_ms(models, ids, decode_steps).items():
        rows[name]["decode_ms"] = ms
    reference = argmax.get("float32")
    for name, row in rows.items():
        if reference is not None:
            row["top1_agreement_vs_float32"] = (argmax[name] == reference).double().mean().item()
        if "float32" in rows:
            row["decode_speedup_vs_float32"] = rows["float32"]["decode_ms"] / row["decode_ms"]
    return {"model": model_name, "text": str(TEXT.name), "tokens": len(ids), "threads": threads, "dtypes": rows}


def format_precision(result: dict[str, Any]) -> str:
    lines = [f"bench precision: {result['model']}, {result['tokens']} tokens of {result['text']}, "
             f"{result['threads']} threads",
             f"{'dtype':<10} {'perplexity':>10} {'top-1 vs fp32':>14} {'decode ms':>10} {'speedup':>8}  kernel"]
    for name, row in result["dtypes"].items():
        agree = row.get("top1_agreement_vs_float32")
        speed = row.get("decode_speedup_vs_float32")
        lines.append(f"{name:<10} {row['perplexity']:>10.3f} {'' if agree is None else f'{agree:.4f}':>14} "
                     f"{row['decode_ms']:>10.1f} {'' if speed is None else f'{speed:.2f}x':>8}  {row.get('linear_kernel', '')}")
    return "\n".join(lines)
