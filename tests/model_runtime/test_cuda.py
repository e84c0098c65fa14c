"""The runtime on CUDA: bf16 forward parity, TP=2 over NCCL against TP=1, and the drafter + verifier sharing a GPU
through Serve (fractional GPUs). Every test skips cleanly without CUDA (and the TP test without two GPUs);
scripts/gpu-check.sh runs them on a machine that has them.

Tolerances. fp32 on CUDA against fp32 on CPU: the same 5e-4 as the transformers parity test (other summation
orders, no TF32: torch leaves matmul TF32 off by default). bf16 (8 bits of mantissa) against fp32: logits of
these models are O(1)..O(20), bf16 rounding of activations moves them by ~1% of their spread, so the check is a
relative one (max |diff| <= 5% of the fp32 logits' range) plus the top token agreeing on >= 90% of positions.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from model_runtime.local_alloc import LocalAllocator, LocalSequence
from model_runtime.model import CausalLM
from model_runtime.tp import TPRank, init_tp_group
from tests.model_runtime.random_checkpoint import make_random_checkpoint

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device (scripts/gpu-check.sh runs these on a GPU machine)")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"TP=2 over NCCL needs 2 CUDA devices, this machine has {GPUS}")

FP32_TOL = 5e-4
BF16_RELATIVE = 0.05
BF16_TOP1_AGREEMENT = 0.9
PROMPT = [1, 17, 33, 90, 4, 250, 11, 3, 42, 8, 199, 5, 77, 123, 9, 8, 7, 6]


def logits_of(model: CausalLM, steps: list[list[int]], block_size: int = 4) -> torch.Tensor:
    """Prefill + decode + a multi-token verify, as one (tokens, vocab) float32 tensor on the CPU."""
    alloc = LocalAllocator(num_blocks=64, block_size=block_size)
    kv = model.allocate_kv(64, block_size)
    seq = LocalSequence()
    out = []
    for tokens in steps:
        (logits,) = model.forward_seqs([alloc.extend(seq, tokens)], kv)
        out.append(logits.float().cpu())
    return torch.cat(out)


def bf16_close(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |diff| / range of want, share of positions whose top token agrees)."""
    spread = (want.max() - want.min()).item()
    relative = (got - want).abs().max().item() / spread
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return relative, agreement


STEPS = [PROMPT[:11], [PROMPT[11]], [PROMPT[12]], PROMPT[13:]]


@needs_cuda
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cuda_fp32_and_bf16_forward_match_the_cpu(arch: str, tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / arch, arch=arch, seed=7)
    want = logits_of(CausalLM.load(ckpt), STEPS)
    fp32 = logits_of(CausalLM.load(ckpt, device="cuda", dtype=torch.float32), STEPS)
    assert (fp32 - want).abs().max().item() < FP32_TOL
    bf16_model = CausalLM.load(ckpt, device="cuda", dtype=torch.bfloat16)
    assert bf16_model.dtype == torch.bfloat16 and bf16_model.device.type == "cuda"
    relative, agreement = bf16_close(logits_of(bf16_model, STEPS), want)
    assert relative <= BF16_RELATIVE and agreement >= BF16_TOP1_AGREEMENT, (relative, agreement)


@needs_cuda
def test_cuda_bf16_smollm2_matches_the_cpu(smollm2_dir: Path) -> None:
    prompt = list(range(100, 140))
    want = logits_of(CausalLM.load(smollm2_dir), [prompt, [7], [8, 9, 10]], block_size=16)
    got = logits_of(CausalLM.load(smollm2_dir, device="cuda", dtype=torch.bfloat16), [prompt, [7], [8, 9, 10]],
                    block_size=16)
    relative, agreement = bf16_close(got, want)
    assert relative <= BF16_RELATIVE and agreement >= BF16_TOP1_AGREEMENT, (relative, agreement)


def _nccl_rank(rank: int, world_size: int, init_method: str, checkpoint: str, dtype: torch.dtype,
               out: Any) -> None:
    import torch.distributed as dist

    init_tp_group(rank, world_size, init_method, device=f"cuda:{rank}")
    try:
        worker = TPRank(checkpoint, rank, world_size, num_blocks=64, block_size=4, device=f"cuda:{rank}", dtype=dtype)
        alloc = LocalAllocator(num_blocks=64, block_size=4)
        a, b = LocalSequence(), LocalSequence()
        batches = [[alloc.extend(a, PROMPT[:7]), alloc.extend(b, PROMPT[7:10])],
                   [alloc.extend(a, [30]), alloc.extend(b, [31, 32, 33, 34])]]
        results = [[t.float().cpu().numpy() for t in worker.forward(batch)] for batch in batches]
        if rank == 0:
            out.put(results)
    finally:
        dist.destroy_process_group()


def nccl_tp2(checkpoint: Path, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        queue = ctx.Queue()
        procs = [ctx.Process(target=_nccl_rank, args=(r, 2, f"file://{tmp}/rendezvous", str(checkpoint), dtype, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            results = queue.get(timeout=300)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [[torch.from_numpy(a) for a in batch] for batch in results]


def tp1_on_cuda(checkpoint: Path, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    model = CausalLM.load(checkpoint, device="cuda:0", dtype=dtype)
    kv = model.allocate_kv(64, 4)
    alloc = LocalAllocator(num_blocks=64, block_size=4)
    a, b = LocalSequence(), LocalSequence()
    batches = [[alloc.extend(a, PROMPT[:7]), alloc.extend(b, PROMPT[7:10])],
               [alloc.extend(a, [30]), alloc.extend(b, [31, 32, 33, 34])]]
    return [[t.float().cpu() for t in model.forward_seqs(batch, kv)] for batch in batches]


@needs_two_gpus
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_nccl_tp2_equals_tp1(arch: str, tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / arch, arch=arch, seed=11, num_heads=4, num_kv_heads=2)
    for dtype in (torch.float32, torch.bfloat16):
        want, got = tp1_on_cuda(ckpt, dtype), nccl_tp2(ckpt, dtype)
        for got_batch, want_batch in zip(got, want, strict=True):
            for g, w in zip(got_batch, want_batch, strict=True):
                assert g.shape == w.shape
                if dtype == torch.float32:
                    assert (g - w).abs().max().item() < FP32_TOL
                else:
                    relative, agreement = bf16_close(g, w)
                    assert relative <= BF16_RELATIVE and agreement >= BF16_TOP1_AGREEMENT, (relative, agreement)


GRPC_PORT, HTTP_PORT = 19730, 18730
MAX_TOKENS = 32


@needs_cuda
@pytest.mark.timeout(600)
def test_serve_drafter_and_verifier_share_a_gpu(ray_session: Any, smollm2_dir: Path) -> None:
    """SmolLM2 drafting for itself on CUDA through the Serve application: the Drafter and the TP=1 Verifier
    each hold half a GPU (one GPU serves both); greedy output with speculation equals output without."""
    from ray import serve

    from cluster.client import SpecServeClient, collect
    from cluster.serving.app import APP_NAME, deploy
    from cluster.serving.config import load_config

    config = load_config(model="smollm2-135m", draft="smollm2-135m", device="cuda", gpus_per_worker=0.5,
                         tensor_parallel_size=1, worker_threads=1, kv_blocks=256, block_size=16, queue_capacity=8,
                         max_batch=4, max_context=512, grpc_port=GRPC_PORT, http_port=HTTP_PORT,
                         graceful_shutdown_wait_loop_s=0.2, graceful_shutdown_timeout_s=2.0)
    deploy(config)
    try:
        status = serve.status().applications[APP_NAME]
        assert status.status == "RUNNING", status
        used = ray_session.cluster_resources()["GPU"] - ray_session.available_resources().get("GPU", 0.0)
        assert used == pytest.approx(1.0), used  # the Drafter's half and the Verifier's half
        with SpecServeClient(f"127.0.0.1:{GRPC_PORT}", 300) as client:
            runs = {}
            for k, draft in ((4, "model"), (0, "none")):
                (sample,) = collect(client.generate("def fibonacci(n):", max_tokens=MAX_TOKENS, k=k, draft=draft,
                                                    contract="greedy", ignore_eos=True)).values()
                runs[(k, draft)] = sample
            speculative, plain = runs[(4, "model")], runs[(0, "none")]
            assert len(plain["token_ids"]) == MAX_TOKENS
            assert speculative["token_ids"] == plain["token_ids"]
            acceptance = speculative["stats"]["acceptance"]
            assert acceptance["accepted"] > 0, acceptance  # the draft model (the target itself) was used
            stats = client.stats()
            assert stats["kv"]["leaked_blocks"] == 0
    finally:
        serve.delete(APP_NAME)
