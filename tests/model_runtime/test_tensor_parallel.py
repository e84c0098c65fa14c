"""TP=2 on gloo (two local processes) equals TP=1 within 1e-4."""

from __future__ import annotations

import pytest

from model_runtime.config import ModelConfig, UnsupportedModelError
from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from model_runtime.tp import run_local_tp
from tests.model_runtime.random_checkpoint import make_random_checkpoint

TOL = 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tp2_equals_tp1(arch: str, tmp_path) -> None:
    ckpt = make_random_checkpoint(tmp_path / arch, arch=arch, seed=11, num_heads=4, num_kv_heads=2)
    alloc = LocalAllocator(num_blocks=64, block_size=4)
    a, b = LocalSequence(), LocalSequence()
    batches = [
        [alloc.extend(a, [1, 5, 9, 13, 17, 21, 25]), alloc.extend(b, [2, 4, 6])],
        [alloc.extend(a, [30]), alloc.extend(b, [31, 32, 33, 34])],
    ]
    tp1 = CausalLM.load(ckpt)
    kv = tp1.allocate_kv(64, 4)
    expected = [tp1.forward_seqs(batch, kv) for batch in batches]
    got = run_local_tp(ckpt, 2, batches, num_blocks=64, block_size=4)
    for got_batch, want_batch in zip(got, expected, strict=True):
        for g, w in zip(got_batch, want_batch, strict=True):
            assert g.shape == w.shape
            assert (g - w).abs().max().item() < TOL


def test_tp_size_must_divide_heads() -> None:
    cfg = ModelConfig(model_type="llama", vocab_size=10, hidden_size=72, intermediate_size=64, num_layers=1,
                      num_heads=9, num_kv_heads=3, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, attention_bias=False, max_position_embeddings=64)
    with pytest.raises(UnsupportedModelError, match="must divide"):
        cfg.check_tensor_parallel(2)
