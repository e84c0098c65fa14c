"""Precision: what `auto` resolves to, bf16 against transformers' bf16 on the same weights, and bf16 rows that
do not depend on the rows sharing their forward (model level, SmolLM2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_runtime import cpu_kernels, precision
from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from model_runtime.precision import draft_dtype, target_dtype

PROMPT = [1, 504, 3458, 282, 4649, 314, 5248, 30, 378, 1117, 314, 2]
STEPS = [[339], [1689], [28], [253, 7001, 4648]]
needs_bf16 = pytest.mark.skipif(not precision.cpu_has_bf16(), reason="no bf16 instructions: auto runs float32")


def test_auto_follows_the_device_and_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_packs_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_packs_int8", lambda: True)
    assert target_dtype("auto", "cpu") == torch.bfloat16 and draft_dtype("auto", "cpu") == torch.int8
    assert draft_dtype("auto", "cuda:0") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_packs_bf16", lambda: False)
    monkeypatch.setattr(precision, "cpu_packs_int8", lambda: False)
    assert draft_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)  # an AVX2 CPU: bf16 on our kernels
    monkeypatch.setattr(precision, "cpu_runs_own_kernels", lambda: True)
    assert target_dtype("auto", "cpu") == torch.bfloat16 and draft_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_runs_own_kernels", lambda: False)  # SPECSERVE_CPU_KERNEL=torch there
    assert target_dtype("auto", "cpu") == torch.float32 and draft_dtype("auto", "cpu") == torch.float16
    assert target_dtype("auto", "cuda:0") == torch.bfloat16
    assert target_dtype("float32", "cuda:0") == torch.float32
    with pytest.raises(ValueError, match="float16"):
        target_dtype("float16", "cpu")  # the target runs float32 or bfloat16 only
    assert draft_dtype("int8", "cpu") == torch.int8  # a draft may run int8 linears (AMX), never the target
    with pytest.raises(ValueError, match="unknown dtype"):
        target_dtype("int8", "cpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        draft_dtype("int4", "cpu")


def test_the_kernel_switch_turns_int8_drafts_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "onednn")
    assert not precision.cpu_packs_bf16() and not precision.cpu_packs_int8()
    assert draft_dtype("auto", "cpu") in (torch.bfloat16, torch.float16)


@pytest.mark.model
def test_auto_runs_the_ggufs_codes_where_amx_does_not(smollm2_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AMX q4 is the fastest exact path at every row count (precision.py): auto picks it for a known
    model on one CPU rank, for target and draft; with AMX, bf16 and int8 as before; never for a checkpoint
    without a GGUF, a tensor-parallel verifier or a GPU."""
    from model_runtime import quant_kernels

    if quant_kernels.active() is None:
        pytest.skip(quant_kernels.describe())
    monkeypatch.setattr(precision, "cpu_packs_bf16", lambda: False)
    monkeypatch.setattr(precision, "cpu_packs_int8", lambda: False)
    assert target_dtype("auto", "cpu", smollm2_dir) == precision.Q4
    assert draft_dtype("auto", "cpu", smollm2_dir) == precision.Q4
    assert precision.why_not_q4(smollm2_dir, "cpu") is None
    assert target_dtype("auto", "cpu", smollm2_dir, tp_size=2) != precision.Q4
    assert "one rank" in str(precision.why_not_q4(smollm2_dir, "cpu", tp_size=2))
    assert target_dtype("auto", "cuda:0", smollm2_dir) == torch.bfloat16
    assert target_dtype("auto", "cpu") != precision.Q4  # no model named: the CPU alone decides
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert target_dtype("auto", "cpu", local) != precision.Q4
    assert "no GGUF" in str(precision.why_not_q4(local, "cpu"))
    refused = tmp_path / "refused"  # a known model whose GGUF `models prepare` found the kernels cannot take
    refused.mkdir()
    (refused / "manifest.json").write_text('{"name": "smollm2-135m", "quant_formats": "none: Q2_K unsupported"}')
    assert precision.why_not_q4(refused, "cpu") == "none: Q2_K unsupported"  # read, not packed again
    assert target_dtype("auto", "cpu", smollm2_dir, max_batch=16) == precision.Q4  # any batch
    monkeypatch.setattr(precision, "cpu_packs_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_packs_int8", lambda: True)
    assert target_dtype("auto", "cpu", smollm2_dir) != precision.Q4
    assert target_dtype("auto", "cpu", smollm2_dir, max_batch=8) != precision.Q4
    assert draft_dtype("auto", "cpu", smollm2_dir) == torch.int8
    monkeypatch.setattr(precision, "cpu_packs_bf16", lambda: False)
    monkeypatch.setattr(precision, "cpu_packs_int8", lambda: False)
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL", "torch")  # no quantized kernel allowed: the dtype is refused
    assert target_dtype("auto", "cpu", smollm2_dir) != precision.Q4


@pytest.mark.model
def test_with_amx_one_stream_runs_the_ggufs_codes(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX, bf16 rows ride nearly free and q4's do not, but q4 decodes one row 1.4-2.3x faster: auto runs q4
    for an engine of one request at a time (max_batch 1) and bf16 for a batching one; the draft stays int8. An
    engine built so says which in its stats, and so does `models list`."""
    from cluster.cli.models import format_table
    from model_runtime import quant_kernels
    from tests.cluster.engine.engine_helpers import local_engine

    if quant_kernels.active() is None:
        pytest.skip(quant_kernels.describe())
    monkeypatch.setattr(precision, "cpu_packs_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_packs_int8", lambda: True)
    assert target_dtype("auto", "cpu", smollm2_dir, max_batch=1) == precision.Q4
    assert target_dtype("auto", "cpu", smollm2_dir, max_batch=2) != precision.Q4
    assert target_dtype("auto", "cpu", smollm2_dir, max_batch=None) != precision.Q4  # not known: a server's
    assert target_dtype("auto", "cpu", smollm2_dir, tp_size=2, max_batch=1) != precision.Q4
    assert draft_dtype("auto", "cpu", smollm2_dir) == torch.int8
    assert local_engine(smollm2_dir, "ngram", max_batch=1, kv_blocks=32).stats()["dtype"] == {"target": "q4"}
    assert local_engine(smollm2_dir, "ngram", max_batch=2, kv_blocks=32).stats()["dtype"]["target"] != "q4"
    assert "q4 alone" in format_table(smollm2_dir.parent)


def incremental_logits(model: CausalLM) -> torch.Tensor:
    alloc, kv, seq = LocalAllocator(64, 4), model.allocate_kv(64, 4), LocalSequence()
    return torch.cat([model.forward_seqs([alloc.extend(seq, new)], kv)[0] for new in [PROMPT, *STEPS]])


def hf_logits(checkpoint: Path, dtype: torch.dtype) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT + [t for s in STEPS for t in s]])).logits[0].float()


@needs_bf16
def test_smollm2_bf16_against_transformers_bf16(smollm2_dir: Path) -> None:
    """Tolerance: mean |ours - transformers| <= 0.2 over all logits (magnitude ~30, one bf16 ulp there is 0.125;
    measured 0.127), and ours about as far from float32 as transformers' own bf16 is: the same precision,
    differently rounded (our attention runs in fp32). Which of the two lands nearer varies with the kernels' exact
    roundings, which these 18 rows amplify (one row carries 1.24 of ours): measured mean 0.206 vs 0.216 on the AMX
    path; on an AMD EPYC 0.251 (avx512 path) and 0.198 (torch path) vs 0.187. So within 1.5x, not below 1.0x.
    Where the libraries round more coarsely (oneDNN and MKL capped at AVX2: transformers' bf16 0.279 from float32),
    two bf16 models may differ by as much as one of them from float32: ours on the torch path there 0.219 from
    transformers, 0.159 from float32. So the bound is 0.2 or transformers' own distance, whichever is larger."""
    ours = incremental_logits(CausalLM.load(smollm2_dir, dtype=torch.bfloat16))
    theirs, fp32 = hf_logits(smollm2_dir, torch.bfloat16), hf_logits(smollm2_dir, torch.float32)
    theirs_error = (theirs - fp32).abs().mean().item()
    assert (ours - theirs).abs().mean().item() < max(0.2, theirs_error)
    assert (ours - fp32).abs().mean().item() <= 1.5 * theirs_error
    assert (ours.argmax(-1) == fp32.argmax(-1)).float().mean().item() >= 0.9


@needs_bf16
def test_smollm2_bf16_rows_do_not_depend_on_their_call(smollm2_dir: Path) -> None:
    """Bitwise: a prefill of 18 tokens = 3 tokens then 15 one-token decodes; three sequences in one forward
    = each alone. Not on the torch path (SPECSERVE_CPU_KERNEL=torch), which promises a bound, not these bits."""
    if not cpu_kernels.for_dtype(torch.bfloat16).exact:
        pytest.skip("SPECSERVE_CPU_KERNEL=torch: the libraries' rows depend on the call (docs/exactness.md)")
    model = CausalLM.load(smollm2_dir, dtype=torch.bfloat16)
    ids = PROMPT + [t for s in STEPS for t in s]
    alloc, kv = LocalAllocator(64, 4), model.allocate_kv(64, 4)
    (whole,) = model.forward_seqs([alloc.extend(LocalSequence(), ids)], kv)
    seq = LocalSequence()
    parts = [model.forward_seqs([alloc.extend(seq, ids[:3])], kv)[0]]
    parts += [model.forward_seqs([alloc.extend(seq, [t])], kv)[0] for t in ids[3:]]
    assert torch.equal(torch.cat(parts), whole)
    seqs = [ids[:7], ids[2:16], ids[5:6]]
    alone = [model.forward_seqs([alloc.extend(LocalSequence(), s)], kv)[0] for s in seqs]
    together = model.forward_seqs([alloc.extend(LocalSequence(), s) for s in seqs], kv)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
