"""Shared helpers for engine tests: plain greedy reference decoding and engine runs."""

from __future__ import annotations

from pathlib import Path

import torch

from cluster.api import GenerationRequest, SamplingParams, SpecParams
from cluster.engine import SpecEngine
from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM


def plain_greedy(checkpoint: Path, prompt: list[int], max_tokens: int, eos: set[int] | None = None) -> list[int]:
    """Plain greedy target decoding with our runtime (itself checked against transformers)."""
    model = CausalLM.load(checkpoint)
    alloc = LocalAllocator(256, 16)
    kv = model.allocate_kv(256, 16)
    seq = LocalSequence()
    (logits,) = model.forward_seqs([alloc.extend(seq, prompt, logits="last")], kv)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(torch.argmax(logits[-1]))
        out.append(token)
        if eos and token in eos:
            break
        (logits,) = model.forward_seqs([alloc.extend(seq, [token])], kv)
    return out


def request(rid: str, prompt: list[int], max_tokens: int = 24, k: int | None = 3, draft: str = "model",
            contract: str = "greedy", temperature: float = 0.0, seed: int | None = None, **sampling) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(prompt),
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, **sampling),
        SpecParams(contract=contract, k=k, draft=draft),
    )


def run(engine: SpecEngine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    for r in requests:
        engine.submit(r)
    chunks = engine.run_to_completion()
    return {rid: [t for c in cs for t in c.token_ids] for rid, cs in chunks.items()}
