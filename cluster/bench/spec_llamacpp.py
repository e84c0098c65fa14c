"""`bench spec`'s llama.cpp peer: native binaries (or the Python binding's loop) on the GGUF files our models are
prepared from, and `--llamacpp-only` (its modes alone over the bench's prompts)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from cluster.bench.bench_prompts import WARMUP_TOKENS, BenchPrompt, load_prompts
from cluster.bench.llamacpp import LlamaCppSettings
from cluster.bench.llamacpp_native import NativeLlamaCpp
from cluster.bench.llamacpp_process import LlamaCppProcess
from cluster.bench.runtime import environment, progress, set_threads
from cluster.bench.spec_settings import SpecSettings
from cluster.engine.factory import tokenize_prompt


def bin_dir(s: SpecSettings) -> Path | None:
    return Path(s.llamacpp_bin) if s.llamacpp_bin else None


def llamacpp_peer(s: SpecSettings, eos_token_ids: Any) -> NativeLlamaCpp | LlamaCppProcess:
    """llama.cpp on the GGUF files `s.model` and `s.draft` are prepared from; modes follow `s.drafts`. Native
    binaries (cluster/bench/llamacpp_native.py) unless `s.llamacpp_python` asks for the Python binding's loop."""
    from cluster.bench.gguf_file import gguf_path

    model_draft = s.draft != "none" and "model" in s.drafts
    progress(f"spec: llama.cpp: loading the GGUF files of {s.model}" + (f" and {s.draft}" if model_draft else ""))
    settings = LlamaCppSettings(
        model_gguf=gguf_path(s.model), draft_gguf=gguf_path(s.draft) if model_draft else None, threads=s.threads,
        n_ctx=s.max_context, draft_tokens=s.llamacpp_draft_tokens, lookup_tokens=s.hf_lookup_tokens,
        lookup="ngram" in s.drafts, eos_token_ids=frozenset(eos_token_ids))
    if s.llamacpp_python:
        return LlamaCppProcess(settings)
    return NativeLlamaCpp(settings, bin_dir(s))


def llamacpp_run(peer: NativeLlamaCpp | LlamaCppProcess, mode: str, prompt: BenchPrompt, prompt_ids: list[int],
                 max_tokens: int, warmup: bool = False) -> None:
    run = peer.run(mode, prompt.id, prompt.category, prompt_ids, max_tokens, warmup)
    if not warmup:
        n = len(run.token_ids)
        progress(f"spec: T=0.0 batch 1 {prompt.id}: llama.cpp {mode}: {n} tokens in {run.seconds:.1f} s "
                 f"({n / run.seconds:.2f} tok/s)")


def run_llamacpp_only(s: SpecSettings) -> dict[str, Any]:
    """`--llamacpp-only`: llama.cpp's modes alone over the bench's prompts (our chat template's token ids),
    interleaved per prompt as in the full run; the JSON has the full run's shape with no results of ours."""
    from cluster.engine.factory import eos_token_ids, load_tokenizer, model_dir
    from model_runtime.config import ModelConfig

    set_threads(s.threads)
    env = environment()
    target_dir = model_dir(s.model)
    tokenizer = load_tokenizer(target_dir)
    prompts = load_prompts(s.categories, s.per_category)
    prompt_ids = {p.id: tokenize_prompt(tokenizer, p.text, chat=True) for p in prompts}
    peer = llamacpp_peer(s, eos_token_ids(target_dir, ModelConfig.from_dir(target_dir), tokenizer))
    modes = peer.modes()
    progress("spec: warm-up")
    for mode in modes:
        llamacpp_run(peer, mode, prompts[0], prompt_ids[prompts[0].id], WARMUP_TOKENS, warmup=True)
    for i, prompt in enumerate(prompts):
        shift = i % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            llamacpp_run(peer, mode, prompt, prompt_ids[prompt.id], s.max_tokens)
    report = peer.report()
    peer.close()
    env["loadavg_at_end"] = list(os.getloadavg())
    settings = dataclasses.asdict(s)
    settings["ks"] = ["auto" if k is None else k for k in s.ks]
    return {"bench": "spec", "settings": settings,
            "prompts": [{"id": p.id, "category": p.category, "prompt_tokens": len(prompt_ids[p.id])} for p in prompts],
            "results": [], "hf": [], "llamacpp": report, "environment": env}
