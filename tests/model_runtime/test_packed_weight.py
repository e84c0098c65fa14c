"""The AMX kernels through packed weights: bf16 batch invariance, accuracy, padding, round trip; int8 accuracy.

Skipped (with the registry's reason) where it cannot run: no AMX, no compiler, SPECSERVE_CPU_KERNEL naming a path
below amx.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_runtime.cpu_kernels import for_dtype
from model_runtime.packed_weight import PackedBF16, PackedInt8, as_tensor
from model_runtime.small_matmul import linear

pytestmark = pytest.mark.skipif(for_dtype(torch.bfloat16).packed is None,
                                reason=f"no kernel packs weights here: {for_dtype(torch.bfloat16).packed_why}")

# Qwen-1.5B's down, gate_up, qkv and lm_head-like width; SmolLM2's down and qkv; odd shapes (padding)
SHAPES = [(1536, 8960), (17920, 1536), (2048, 1536), (576, 1536), (960, 576), (100, 70), (33, 31)]


def _weight(shape: tuple[int, int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(*shape, generator=gen) * 0.02).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16()
    x = torch.randn(80, shape[1], generator=gen).bfloat16()
    return weight, bias, x


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_has_the_same_bits_for_any_row_count(shape: tuple[int, int]) -> None:
    """A row alone (plain decoding) and the same row among 1..80 others, at any position, give the same bits."""
    weight, bias, x = _weight(shape)
    packed = PackedBF16(weight)
    alone = torch.cat([linear(x[i:i + 1], packed, bias) for i in range(80)])
    gen = torch.Generator().manual_seed(2)
    for rows in (2, 3, 5, 8, 9, 15, 16, 17, 31, 32, 33, 47, 64, 65, 80):
        perm = torch.randperm(80, generator=gen)[:rows]
        assert torch.equal(linear(x[perm], packed, bias), alone[perm]), rows


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_a_float32_product_within_bf16_rounding(shape: tuple[int, int]) -> None:
    """Error against the fp32 product of the same bf16 values: at most one bf16 rounding of the output
    (2^-8 relative) plus fp32 accumulation; oneDNN's bf16 F.linear is held to the same bound."""
    weight, bias, x = _weight(shape)
    packed = PackedBF16(weight)
    exact = F.linear(x.float(), weight.float(), bias.float())
    ours = linear(x, packed, bias).float()
    bound = exact.abs() * 2.0 ** -8 + 1e-4 * exact.abs().max()
    assert ((ours - exact).abs() <= bound).all()
    onednn = F.linear(x, weight, bias).float()
    assert ((onednn - exact).abs() <= bound).all()
    fp32_out = packed(x, bias, out_fp32=True)
    assert fp32_out.dtype == torch.float32
    assert (fp32_out - exact).abs().max().item() <= 1e-4 * exact.abs().max().item()
    assert torch.equal(fp32_out.bfloat16(), linear(x, packed, bias))


@pytest.mark.parametrize("shape", SHAPES)
def test_unpack_gives_back_the_weight(shape: tuple[int, int]) -> None:
    weight, _, _ = _weight(shape)
    packed = PackedBF16(weight)
    assert packed.shape == weight.shape and packed.numel() == weight.numel()
    assert torch.equal(as_tensor(packed), weight)
    assert as_tensor(weight) is weight


def test_no_bias_and_non_contiguous_input() -> None:
    weight, _, x = _weight((64, 96))
    packed = PackedBF16(weight)
    strided = x.T.contiguous().T  # same values, column-major
    assert not strided.is_contiguous()
    assert torch.equal(linear(strided, packed), linear(x, packed))
    assert linear(x[:0], packed).shape == (0, 64)
    int8 = PackedInt8(weight)
    assert linear(x[:0], int8).shape == (0, 64) and linear(strided, int8).shape == (80, 64)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 40])
def test_a_float32_bias_adds_the_same_values_as_its_bfloat16_self(rows: int) -> None:
    """The kernel widens a bf16 bias itself (the model's) and takes a float32 one as it is: same values, same bits."""
    weight, bias, x = _weight((96, 64))
    packed = PackedBF16(weight)
    for out_fp32 in (False, True):
        assert torch.equal(packed(x[:rows], bias, out_fp32), packed(x[:rows], bias.float(), out_fp32))


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_stays_within_quantisation_error(shape: tuple[int, int]) -> None:
    """W8A8 (per-output weight scales, per-row activation scales): the relative error of each row's output is a
    few percent at most on Gaussian data (measured ~1.1%), and the dequantized weight is within half a step."""
    weight, bias, x = _weight(shape)
    packed = PackedInt8(weight)
    exact = F.linear(x.float(), weight.float(), bias.float())
    ours = linear(x, packed, bias).float()
    assert ours.dtype == torch.float32 and linear(x, packed, bias).dtype == torch.bfloat16
    rel = (ours - exact).norm(dim=1) / exact.norm(dim=1)
    assert rel.max().item() < 0.05, rel.max().item()
    step = weight.float().abs().amax(dim=1, keepdim=True) / 127
    # half a quantisation step, plus unpack's rounding to bf16
    assert ((as_tensor(packed).float() - weight.float()).abs() <= step * 0.5 + weight.float().abs() * 2 ** -8).all()
    alone = torch.cat([linear(x[i:i + 1], packed, bias) for i in range(0, 80, 7)])
    assert torch.equal(alone, linear(x[::7], packed, bias))  # per-row scales: a row alone is the same row
    assert torch.equal(alone, linear(x, packed, bias)[::7])  # among 80 rows (five 16-row blocks) too
    among = linear(x, packed, bias)
    for rows in range(1, 17):  # 1..16 rows (one tile of that many rows) against 80 (16-row tiles)
        assert torch.equal(linear(x[:rows], packed, bias), among[:rows]), rows


def test_an_int8_model_agrees_with_its_bf16_self(smollm2_dir: Path) -> None:
    """SmolLM2 on the shipped quality text: the int8 model's next-token choice agrees with bf16's at most
    positions (a draft's agreement is what acceptance pays for)."""
    from cluster.bench.precision import TEXT
    from cluster.engine.factory import load_tokenizer
    from model_runtime.local_alloc import LocalAllocator, LocalSequence
    from model_runtime.model import CausalLM

    ids = list(load_tokenizer(smollm2_dir)(TEXT.read_text(encoding="utf-8"))["input_ids"])[:256]
    argmax = {}
    for dtype in (torch.bfloat16, torch.int8):
        model = CausalLM.load(smollm2_dir, dtype=dtype)
        assert model.linear_kernel == ("amx-int8" if dtype == torch.int8 else "amx")
        (logits,) = model.forward_seqs([LocalAllocator(20, 16).extend(LocalSequence(), ids)], model.allocate_kv(20, 16))
        argmax[dtype] = logits.argmax(-1)
    agreement = (argmax[torch.bfloat16] == argmax[torch.int8]).double().mean().item()
    assert agreement > 0.85, agreement


_ONE_THREAD = """
import sys, torch
torch.set_num_threads(1)  # at::parallel_for then runs the kernel's passes inline, on this thread alone
from model_runtime.packed_weight import PackedBF16, PackedInt8
gen = torch.Generator().manual_seed(5)
weight = (torch.randn(96, 64, generator=gen) * 0.02).bfloat16()
x = torch.randn(40, 64, generator=gen).bfloat16()
bf16, i8 = PackedBF16(weight), PackedInt8(weight)
torch.save([bf16(x[:rows]) for rows in (1, 5, 17, 40)] + [i8(x[:rows]) for rows in (1, 5, 17, 40)], sys.argv[1])
"""


def test_one_torch_thread_gives_the_same_bits_as_two(tmp_path: Path) -> None:
    """With one torch thread the passes run inline on the caller: every path (<= 16, 17..32, > 32 rows, int8)
    configures its tiles there too (a dropped tile configuration once made this die of SIGILL), with the bits of
    two threads. In a subprocess, so that a crash fails this test instead of the run."""
    import subprocess
    import sys

    out = tmp_path / "one_thread.pt"
    run = subprocess.run([sys.executable, "-c", _ONE_THREAD, str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(96, 64, generator=gen) * 0.02).bfloat16()
    x = torch.randn(40, 64, generator=gen).bfloat16()
    bf16, i8 = PackedBF16(weight), PackedInt8(weight)
    mine = [bf16(x[:rows]) for rows in (1, 5, 17, 40)] + [i8(x[:rows]) for rows in (1, 5, 17, 40)]
    for a, b in zip(torch.load(out), mine, strict=True):
        assert torch.equal(a, b)
