"""Tensor parallelism through torch.distributed: gloo on CPU, NCCL on CUDA.

Every rank runs the same forward on the same batch (SPMD); attention heads and MLP columns are
sharded (model_runtime/weights.py) and partial outputs are all-reduced. Rank 0 returns logits.
The verifier deployment runs one `TPRank` per Ray actor; `run_local_tp` spawns plain processes
(tests, benchmarks).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_runtime.batch import SeqInput
from model_runtime.graph.modes import CapturePlan, CaptureUnsupportedError
from model_runtime.graph.runner import CapturedRunner
from model_runtime.model import CausalLM

log = logging.getLogger("specserve.model")


def default_backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def default_dtype(device: str) -> torch.dtype:
    """A rank built without a dtype (tests, `run_local_tp`); served models get `precision.target_dtype`."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def init_tp_group(rank: int, world_size: int, init_method: str, device: str = "cpu") -> None:
    """Join the tensor-parallel group. `init_method` is file:// or tcp:// (loopback for a local run)."""
    if init_method.startswith(("file://", "tcp://127.", "tcp://localhost")):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(default_backend(device), init_method=init_method, rank=rank, world_size=world_size)


class TPRank:
    """One rank: its shard of the weights and its shard of the paged KV pool (owner of both).

    `capture` (one rank only; model_runtime/graph/modes.py): the steps run through a CapturedRunner over the same
    model, whose pool is this rank's (`kv`: the ledger's `num_blocks`, then the runner's scratch blocks), every
    bucket captured here, at start-up; a step outside the buckets (a prefill) runs the eager forward on that pool.
    None: the eager forward, as it always ran. An auto plan (`fallback`) whose capture fails at start-up leaves the
    rank on the eager forward, the failure in `capture_failure`; a named mode's failure is raised."""

    def __init__(self, checkpoint_dir: str | Path, rank: int, world_size: int, num_blocks: int, block_size: int,
                 device: str = "cpu", dtype: torch.dtype | None = None, capture: CapturePlan | None = None) -> None:
        if capture is not None and world_size != 1:
            raise CaptureUnsupportedError(f"capture: {capture.mode!r} runs one rank, not {world_size}")
        self.model = CausalLM.load(checkpoint_dir, tp_rank=rank, tp_size=world_size,
                                   dtype=dtype or default_dtype(device), device=device)
        self.captured = None
        self.capture_failure: str | None = None  # auto's capture that failed at start-up: why (the eager forward runs)
        if capture is not None:
            try:
                self.captured = self._capture(capture, num_blocks, block_size)
            except Exception as exc:
                if not capture.fallback:
                    raise
                log.warning("capture %s failed at start-up (%r): the eager forward runs", capture.mode, exc)
                self.capture_failure = f"{capture.mode}: {exc!r}"[:500]
                if str(device).startswith("cuda"):
                    torch.cuda.empty_cache()  # the failed runner's pool and graphs
        self.kv = self.captured.kv if self.captured is not None else self.model.allocate_kv(num_blocks, block_size)

    def _capture(self, capture: CapturePlan, num_blocks: int, block_size: int) -> CapturedRunner:
        runner = CapturedRunner(self.model, num_blocks, block_size, capture.buckets, capture.mode,
                                backend=capture.backend)
        self.capture_warm_up = runner.warm_up()  # every bucket's program, on padding (scratch slots only)
        return runner

    @property
    def forward_kind(self) -> str:
        """What runs the steps, for the worker's start-up log: eager, captured (mode), or auto's failed capture."""
        if self.captured is not None:
            return f"captured ({self.captured.verify.mode})"
        return "eager" if self.capture_failure is None else f"eager (capture failed: {self.capture_failure})"

    def forward(self, seqs: list[SeqInput]) -> list[torch.Tensor]:
        if self.captured is not None and seqs:
            return self.captured.forward_seqs(seqs)
        return self.model.forward_seqs(seqs, self.kv)


def _rank_main(rank: int, world_size: int, init_method: str, checkpoint_dir: str, num_blocks: int,
               block_size: int, batches: list[list[SeqInput]], out_queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    init_tp_group(rank, world_size, init_method)
    try:
        worker = TPRank(checkpoint_dir, rank, world_size, num_blocks, block_size)
        results = [worker.forward(batch) for batch in batches]
        if rank == 0:
            out_queue.put([[t.numpy() for t in r] for r in results])  # by value, not shared memory
    finally:
        dist.destroy_process_group()


def run_local_tp(checkpoint_dir: str | Path, world_size: int, batches: list[list[SeqInput]],
                 num_blocks: int = 64, block_size: int = 16) -> list[list[torch.Tensor]]:
    """Run `batches` in order on `world_size` local CPU processes; return rank 0's logits."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/tp-rendezvous"
        queue: mp.Queue = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_method, str(checkpoint_dir), num_blocks,
                                                      block_size, batches, queue)) for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            results = queue.get(timeout=300)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        for p in procs:
            if p.exitcode not in (0, None):
                raise RuntimeError(f"tensor-parallel rank exited with {p.exitcode}")
        return [[torch.from_numpy(a) for a in r] for r in results]
