"""Ragged batches and tree masks give the same logits as running each sequence alone."""

from __future__ import annotations

import pytest
import torch

from model_runtime.batch import SeqInput
from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from tests.model_runtime.random_checkpoint import make_random_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    return CausalLM.load(make_random_checkpoint(tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=3))


def prefill(model: CausalLM, alloc: LocalAllocator, kv, prompt: list[int]) -> LocalSequence:
    seq = LocalSequence()
    model.forward_seqs([alloc.extend(seq, prompt, logits="none")], kv)
    return seq


def test_ragged_batch_equals_each_sequence_alone(model: CausalLM) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 9, 16, 1)]
    new_tokens = [[5], [6, 7, 8], [9, 10, 11, 12, 13], list(range(20, 37))]  # decode, verify, crossing, prefill
    # alone
    alone: list[torch.Tensor] = []
    for prompt, new in zip(prompts, new_tokens, strict=True):
        alloc = LocalAllocator(64, 4)
        kv = model.allocate_kv(64, 4)
        seq = prefill(model, alloc, kv, prompt)
        (logits,) = model.forward_seqs([alloc.extend(seq, new)], kv)
        alone.append(logits)
    # batched, sharing one pool, blocks interleaved between sequences
    alloc = LocalAllocator(128, 4)
    kv = model.allocate_kv(128, 4)
    seqs = [prefill(model, alloc, kv, p) for p in prompts]
    batched = model.forward_seqs([alloc.extend(s, new) for s, new in zip(seqs, new_tokens, strict=True)], kv)
    for got, want in zip(batched, alone, strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < TOL


def test_tree_mask_matches_linear_paths(model: CausalLM) -> None:
    #        root(40)
    #        /      \
    #     a(41)     b(42)
    #      |          |
    #     c(43)     d(44)
    tokens = [40, 41, 42, 43, 44]
    parent = [-1, 0, 0, 1, 2]
    depth = [0, 1, 1, 2, 2]
    n = len(tokens)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        walk = node
        while walk != -1:
            mask[node, walk] = True
            walk = parent[walk]
    prompt = [1, 7, 9, 11, 13, 15]
    alloc = LocalAllocator(64, 4)
    kv = model.allocate_kv(64, 4)
    seq = prefill(model, alloc, kv, prompt)
    # one slot per node (beyond the past), positions by depth
    nodes_item = alloc.extend(seq, tokens)
    tree_item = SeqInput(token_ids=tokens, past_len=len(prompt), block_table=nodes_item.block_table,
                         slot_mapping=nodes_item.slot_mapping, positions=[len(prompt) + d for d in depth],
                         attn_mask=mask)
    (tree_logits,) = model.forward_seqs([tree_item], kv)
    for node in range(n):
        path: list[int] = []
        walk = node
        while walk != -1:
            path.insert(0, walk)
            walk = parent[walk]
        alloc2 = LocalAllocator(64, 4)
        kv2 = model.allocate_kv(64, 4)
        seq2 = prefill(model, alloc2, kv2, prompt)
        (linear,) = model.forward_seqs([alloc2.extend(seq2, [tokens[i] for i in path])], kv2)
        assert (tree_logits[node] - linear[-1]).abs().max().item() < TOL


def test_logits_selection_last_and_none(model: CausalLM) -> None:
    alloc = LocalAllocator(32, 4)
    kv = model.allocate_kv(32, 4)
    a, b = LocalSequence(), LocalSequence()
    out = model.forward_seqs([alloc.extend(a, [1, 2, 3], logits="last"), alloc.extend(b, [4, 5], logits="none")], kv)
    assert out[0].shape == (1, model.config.vocab_size)
    assert out[1].shape == (0, model.config.vocab_size)
