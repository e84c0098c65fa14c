"""Log-probabilities of the real models against transformers' float32 log-softmax on the same prepared weights
(issue 70): SmolLM2-135M (prepared by `make setup`), and the Qwen pair (qwen2.5-coder-0.5b and -1.5b) where this
machine has them prepared (`specserve models prepare NAME`; skipped, and said so, where not: they are not part of
the setup's downloads).

A chat prompt is scored by the engine in float32 (`max_tokens` 0, `prompt_logprobs` 5: the verifier's forward over
the prompt, through the paged KV) and by a plain transformers float32 forward; every position's own log-probability
and its top 5 agree within TOLERANCE (float32 kernels summing in another order; the largest differences measured on
an AMD EPYC, 2026-12-07, own / top 5: SmolLM2 2.6e-5 / 3.1e-5, Qwen 0.5B 9.3e-6 / 2.1e-5, Qwen 1.5B 7.8e-5 /
8.7e-5), and the top ids are transformers' own wherever its top-5 values are apart by more than the tolerance. No
leaked block, an empty ledger."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve_types.api import GenerationRequest, SamplingParams, SpecParams
from tests.cluster.engine.engine_helpers import local_engine, prepared_model

TOLERANCE = 1e-4
TOP = 5
MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


def engine_rows(checkpoint: Path, prompt: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    engine = local_engine(checkpoint, "none", dtype="float32", max_batch=1, kv_blocks=64, block_size=16)
    request = GenerationRequest("score", tuple(prompt), SamplingParams(max_tokens=0, prompt_logprobs=TOP),
                                SpecParams(k=0))
    engine.submit(request)
    chunks = engine.run_to_completion()["score"]
    engine.check_ledger()
    engine.kv.audit().assert_no_leaks()
    engine.close()
    (rows,) = [c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None]
    return rows.token_logprobs, rows.top_ids, rows.top_logprobs


def transformers_rows(checkpoint: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    del model
    gc.collect()
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_prompt_logprobs_are_transformers_float32(name: str) -> None:
    from transformers import AutoTokenizer

    checkpoint = prepared_model(name)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    prompt += tokenizer("def fib(n):\n    if n < 2:\n        return n\n")["input_ids"]
    own, top_ids, top_logprobs = engine_rows(checkpoint, prompt)
    reference = transformers_rows(checkpoint, prompt)
    positions = torch.arange(len(prompt) - 1)
    expected = reference[positions, torch.tensor(prompt[1:])]
    own_diff = float((torch.from_numpy(own).double() - expected.double()).abs().max())
    expected_top = reference.topk(TOP, dim=-1)
    top_diff = float((torch.from_numpy(top_logprobs).double() - expected_top.values.double()).abs().max())
    print(f"{name}: {len(prompt) - 1} positions, own max |d| {own_diff:.2e}, top-{TOP} max |d| {top_diff:.2e}")
    assert own_diff <= TOLERANCE and top_diff <= TOLERANCE
    values = reference.topk(TOP + 1, dim=-1).values  # a 6th value close to the 5th makes the 5th's id a tie too
    gaps = (values[:, :-1] - values[:, 1:]).abs() > TOLERANCE  # [positions, TOP]: rank i apart from rank i + 1
    apart = gaps & torch.cat([torch.ones(len(gaps), 1, dtype=torch.bool), gaps[:, :-1]], dim=1)  # and from i - 1
    assert torch.equal(torch.from_numpy(top_ids.astype(np.int64))[apart], expected_top.indices[apart])
