"""Our paged forward against transformers on the same weights (fp32, max abs logits diff 5e-4).

Both are fp32 but sum the dot products in different orders (our small-row linears run as W @ x^T in
4-column blocks, see model_runtime/model.py), which moves SmolLM2's logits (magnitude ~20) by up to
~2e-4, a relative 1e-5. Greedy tokens are checked for identity separately.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from tests.model_runtime.random_checkpoint import make_random_checkpoint

TOL = 5e-4


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def random_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, seed=7)


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def check_incremental_parity(ckpt: Path, prompt: list[int], steps: list[list[int]]) -> None:
    ours = CausalLM.load(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    alloc = LocalAllocator(num_blocks=64, block_size=4)
    kv = ours.allocate_kv(64, 4)
    seq = LocalSequence()
    history: list[int] = []
    for new_tokens in [prompt, *steps]:
        (logits,) = ours.forward_seqs([alloc.extend(seq, new_tokens)], kv)
        history.extend(new_tokens)
        expected = hf_logits(hf, history)[-len(new_tokens):]
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() < TOL


def test_prefill_decode_verify_match_transformers(random_ckpt: Path) -> None:
    prompt = [1, 17, 33, 90, 4, 250, 11, 3, 42, 8, 199]  # 11 tokens: crosses two block boundaries
    check_incremental_parity(random_ckpt, prompt, [[5], [77], [123], [9, 8, 7, 6]])


def check_greedy_matches_generate(ckpt: Path, prompt: list[int], block_size: int, steps: int = 64) -> None:
    ours = CausalLM.load(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                           pad_token_id=0)[0, len(prompt):].tolist()
    alloc = LocalAllocator(num_blocks=64, block_size=block_size)
    kv = ours.allocate_kv(64, block_size)
    seq = LocalSequence()
    (logits,) = ours.forward_seqs([alloc.extend(seq, prompt, logits="last")], kv)
    generated: list[int] = []
    for _ in range(steps):
        token = int(logits[-1].argmax())
        generated.append(token)
        (logits,) = ours.forward_seqs([alloc.extend(seq, [token])], kv)
    assert generated == expected


def test_greedy_64_tokens_match_generate(random_ckpt: Path) -> None:
    check_greedy_matches_generate(random_ckpt, [1, 55, 66, 77, 88], block_size=4)


def test_smollm2_matches_transformers(smollm2_dir: Path) -> None:
    prompt = [1, 504, 3458, 282, 4649, 314, 5248, 30, 378, 1117, 314, 2]
    check_incremental_parity(smollm2_dir, prompt, [[339], [1689], [28], [253, 7001, 4648]])


def test_smollm2_greedy_64_tokens_match_generate(smollm2_dir: Path) -> None:
    check_greedy_matches_generate(smollm2_dir, [504, 3458, 282, 4649, 314, 5248, 30], block_size=16)
