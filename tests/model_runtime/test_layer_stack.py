"""The decoder layers' C++ loops (CausalLM._stack: model_runtime/kernels/layers.cpp for AMX-packed linears,
kernels/q4_layers.cpp for the GGUF's codes) give the Python loop's bits: ragged batches (prefill, decode, verify, a
tree, rows in several key-width groups, padded groups, rows of any width), bf16, int8 and q4 linears, random and real
weights. The packed loop's tests are skipped where no kernel packs weights here (no AMX), the q4 loop's where no
quantized kernel builds (the model then has no stack)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model_runtime import quant_kernels
from model_runtime.batch import SeqInput
from model_runtime.cpu_kernels import for_dtype
from model_runtime.kv_pool import KVPool
from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from model_runtime.precision import Q4
from tests.model_runtime.random_checkpoint import make_random_checkpoint

amx = pytest.mark.skipif(for_dtype(torch.bfloat16).packed is None, reason=for_dtype(torch.bfloat16).packed_why)
WIDE = 552  # keys: past the 512 the AMX build's own attention once stopped at (both loops now take any width)
q4 = pytest.mark.skipif(quant_kernels.active() is None, reason=quant_kernels.describe())


def _tree(prompt_len: int, seq: LocalSequence, alloc: LocalAllocator) -> SeqInput:
    """A 5-node draft tree (root, two children, a grandchild under each) after the sequence's past."""
    tokens, parent, depth = [40, 41, 42, 43, 44], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for node in range(5):
        walk = node
        while walk != -1:
            mask[node, walk] = True
            walk = parent[walk]
    item = alloc.extend(seq, tokens)
    return SeqInput(token_ids=tokens, past_len=prompt_len, block_table=item.block_table,
                    slot_mapping=item.slot_mapping, positions=[prompt_len + d for d in depth], attn_mask=mask)


def _two_forwards(model: CausalLM, use_stack: bool) -> tuple[list[torch.Tensor], KVPool]:
    """A prefill of four sequences, then one forward holding a decode row, a verify of 4, a tree and 17 new rows
    (every width group padded, widths 64 to 192), on a fresh pool."""
    stack = model._stack
    model._stack = stack if use_stack else None
    try:
        gen = torch.Generator().manual_seed(1)
        alloc = LocalAllocator(96, 16)
        kv = model.allocate_kv(96, 16)
        lengths = (30, 75, 140, 9)
        seqs = [LocalSequence() for _ in lengths]
        prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in lengths]
        first = model.forward_seqs([alloc.extend(s, p, logits="last") for s, p in zip(seqs, prompts, strict=True)],
                                   kv)
        second = model.forward_seqs([alloc.extend(seqs[0], [5]), alloc.extend(seqs[1], [6, 7, 8, 9]),
                                     _tree(lengths[2], seqs[2], alloc), alloc.extend(seqs[3], list(range(50, 67)))],
                                    kv)
        return [*first, *second], kv
    finally:
        model._stack = stack


def _assert_same_bits(model: CausalLM) -> None:
    assert model._stack is not None
    ours, kv_ours = _two_forwards(model, use_stack=True)
    theirs, kv_theirs = _two_forwards(model, use_stack=False)
    for got, want in zip(ours, theirs, strict=True):
        assert torch.equal(got, want)
    for a, b in zip(kv_ours.k + kv_ours.v, kv_theirs.k + kv_theirs.v, strict=True):  # the same cache written
        assert torch.equal(a, b)


@amx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_random_weights_give_the_python_loops_bits(tmp_path: Path, dtype: torch.dtype) -> None:
    ckpt = make_random_checkpoint(tmp_path, arch="qwen2", seed=5, hidden_size=256, num_heads=4, num_kv_heads=2,
                                  intermediate_size=512)  # qkv bias, head dim 64, 2 query heads per kv head
    _assert_same_bits(CausalLM.load(ckpt, dtype=dtype))


@amx
def test_smollm2_gives_the_python_loops_bits(smollm2_dir: Path) -> None:
    _assert_same_bits(CausalLM.load(smollm2_dir, dtype=torch.bfloat16))  # llama: no bias, 3 query heads per kv head


def _rows_of_any_width_give_the_python_loops_bits(model: CausalLM) -> None:
    """A prompt of WIDE keys and a verify after it run the C++ loop (each forward once) with the Python loop's bits,
    logits and cache."""
    stack = model._stack
    calls: list[int] = []

    class Counting:
        def forward(self, *args: object) -> torch.Tensor:
            calls.append(1)
            return stack.forward(*args)  # type: ignore[union-attr]

    def run(use_stack: bool) -> tuple[list[torch.Tensor], KVPool]:
        model._stack = Counting() if use_stack else None
        try:
            alloc, kv, seq = LocalAllocator(64, 16), model.allocate_kv(64, 16), LocalSequence()
            first = model.forward_seqs([alloc.extend(seq, [3 + i % 200 for i in range(WIDE)], logits="last")], kv)
            return [*first, *model.forward_seqs([alloc.extend(seq, [7, 8, 9])], kv)], kv
        finally:
            model._stack = stack

    ours, kv_ours = run(True)
    assert calls == [1, 1]
    theirs, kv_theirs = run(False)
    for got, want in zip(ours, theirs, strict=True):
        assert torch.equal(got, want)
    for a, b in zip(kv_ours.k + kv_ours.v, kv_theirs.k + kv_theirs.v, strict=True):
        assert torch.equal(a, b)


@amx
def test_the_packed_loop_takes_rows_of_any_width(tmp_path: Path) -> None:
    """Its attention is the portable kernels' (the registry's rows), which take every key width."""
    model = CausalLM.load(make_random_checkpoint(tmp_path, arch="qwen2", seed=6), dtype=torch.bfloat16)
    assert type(model._stack).__name__ == "LayerStack"
    _rows_of_any_width_give_the_python_loops_bits(model)


@q4
def test_q4_smollm2_gives_the_python_loops_bits(smollm2_dir: Path) -> None:
    model = CausalLM.load(smollm2_dir, dtype=Q4)
    assert type(model._stack).__name__ == "Q4LayerStack"
    _assert_same_bits(model)


@q4
def test_q4_with_a_qkv_bias_gives_the_python_loops_bits(smollm2_dir: Path) -> None:
    """Qwen2's q|k|v bias, added after the quantized linear (SmolLM2 has none: a random one here)."""
    model = CausalLM.load(smollm2_dir, dtype=Q4)
    gen = torch.Generator().manual_seed(3)
    layers = [replace(lw, qkv_bias=torch.randn(lw.qkv.shape[0], generator=gen)) for lw in model.weights.layers]
    biased = CausalLM(model.config, replace(model.weights, layers=layers))
    assert biased._stack is not None
    _assert_same_bits(biased)


@q4
def test_q4_loop_takes_rows_of_any_width(smollm2_dir: Path) -> None:
    """The q4 loop's attention is the portable kernels', which take every key width."""
    _rows_of_any_width_give_the_python_loops_bits(CausalLM.load(smollm2_dir, dtype=Q4))
