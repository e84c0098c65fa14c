"""The Drafter deployment: one replica hosts a DraftWorker (the draft model and its paged KV pool).

    scheduler --ProposeBatch--> Drafter.propose --> DraftWorker --ProposeResult--> scheduler

Only built when the cluster has a draft model (`draft: ngram` drafts inside the scheduler). The
engine is the only caller and calls once per round. The model and its KV pool are owned by the
replica's `ComputeThread`: loading and every `propose` run there, never on Serve's threads.
"""

from __future__ import annotations

import logging
import os

from ray import serve

from drafter_service.worker import DraftWorker
from model_runtime.compute_thread import ComputeThread
from specserve_types.round_messages import ProposeBatch, ProposeResult

logger = logging.getLogger("ray.serve")


class Drafter:
    def __init__(self, model: str, num_blocks: int, block_size: int, device: str = "cpu",
                 worker_threads: int = 0, dtype: str = "auto") -> None:
        from model_runtime.prepare import prepare_model
        from model_runtime.tp import draft_dtype
        from verifier_service.worker import LocalRunner

        self.compute = ComputeThread("drafter-compute", worker_threads)
        checkpoint = prepare_model(model, progress=False)
        device = "cuda:0" if device.startswith("cuda") else device  # Ray shows only the assigned GPU
        precision = draft_dtype(dtype, device)
        self.worker = self.compute.call(
            lambda: DraftWorker(LocalRunner(str(checkpoint), num_blocks, block_size, device, precision)))
        self.model = model
        logger.info("drafter ready: %s (%s), %d KV blocks of %d", model, precision, num_blocks, block_size)

    async def propose(self, batch: ProposeBatch) -> ProposeResult:
        return await self.compute.run(self.worker.propose, batch)

    def vocab_size(self) -> int:
        return self.worker.config.vocab_size

    def pid(self) -> int:
        """The replica's process id (fault-injection tests kill it)."""
        return os.getpid()


DrafterDeployment = serve.deployment(Drafter, name="Drafter")
