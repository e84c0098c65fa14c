"""The Drafter deployment: one replica hosts a DraftWorker (the draft model and its paged KV pool).

    scheduler --ProposeBatch--> Drafter.propose --> DraftWorker --ProposeResult--> scheduler

Only built when the cluster has a draft model (`draft: ngram` drafts inside the scheduler). The
engine is the only caller and calls once per round. The model and its KV pool are owned by the
replica's `ComputeThread`: loading and every `propose` run there, never on Serve's threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence

import numpy as np
from ray import serve

from drafter_service.draft_constraints import DraftConstraints, tokenizer_compiler
from drafter_service.worker import DraftWorker
from model_runtime.compute_thread import ComputeThread
from model_runtime.graph.modes import CaptureSettings
from specserve_types.faults import FAULTS, FaultHooks
from specserve_types.ray_channel import ChannelHost
from specserve_types.round_channel import Handler
from specserve_types.round_messages import ProposeBatch, ProposeOutput, ProposeResult
from specserve_types.tracing import TracingSettings, configure_tracing, tracing_enabled, worker_span

logger = logging.getLogger("ray.serve")


class Drafter(FaultHooks, ChannelHost):
    def __init__(self, model: str, num_blocks: int, block_size: int, device: str = "cpu",
                 worker_threads: int = 0, dtype: str = "auto", cpus: Sequence[int] | None = None,
                 capture: CaptureSettings | None = None) -> None:
        """`capture`: the config's (model_runtime/graph/modes.py), resolved here against the device and the
        precision; None: off."""
        from model_runtime.config import ModelConfig
        from model_runtime.precision import draft_dtype, dtype_name
        from model_runtime.prepare import prepare_model
        from verifier_service.worker import LocalRunner

        self.compute = ComputeThread("drafter-compute", worker_threads, cpus)  # cpus: cluster/serving/cpu_binding.py
        checkpoint = prepare_model(model, progress=False)
        device = "cuda:0" if device.startswith("cuda") else device  # Ray shows only the assigned GPU
        precision = draft_dtype(dtype, device, checkpoint)
        plan = (capture or CaptureSettings()).plan(device, 1, dtype_name(precision), block_size,
                                                   ModelConfig.from_dir(checkpoint).max_position_embeddings)
        runner = self.compute.call(LocalRunner, str(checkpoint), num_blocks, block_size, device, precision, plan)
        self.compute.call(runner.warm_up, block_size)  # a replacement's first propose is not a cold start
        constraints = DraftConstraints(tokenizer_compiler(str(checkpoint), runner.config.vocab_size), prebuild=True)
        self.worker = self.compute.call(DraftWorker, runner, constraints)
        self.model = model
        configure_tracing(TracingSettings.from_env(), "specserve-drafter")  # env set by the app (runtime_env)
        logger.info("drafter ready: %s (%s), %d KV blocks of %d, forward %s", model, precision, num_blocks, block_size,
                    runner.rank.forward_kind)

    async def propose(self, batch: ProposeBatch) -> ProposeResult:
        """Through Serve (`round_transport: ray`)."""
        return await asyncio.to_thread(lambda: self.propose_soon(batch).result())

    def propose_soon(self, batch: ProposeBatch) -> concurrent.futures.Future[ProposeResult]:
        """One round's drafts, queued on the compute thread (the round channel's handler: the compute thread
        sends the answer as the draft steps end). An injected latency delays the answer,
        not the compute thread (which may be the one calling: it reads the channel's connections)."""
        if FAULTS.active and (delay := FAULTS.take("drafter.latency")) is not None:
            return self.compute.submit_after(float(delay.get("seconds", 1.0)), self._propose, batch)
        return self.compute.submit(self._propose, batch)

    def _propose(self, batch: ProposeBatch) -> ProposeResult:
        """On the compute thread."""
        if batch.trace_context and tracing_enabled():  # the round's trace continues here (specserve_types/tracing.py)
            with worker_span("drafter.propose", batch.trace_context, len(batch.items)):
                return self._faulty_propose(batch)
        return self._faulty_propose(batch)

    def _faulty_propose(self, batch: ProposeBatch) -> ProposeResult:
        result = self.worker.propose(batch)
        if FAULTS.active and (garbage := FAULTS.take("drafter.garbage")) is not None:
            result = garbage_drafts(result, self.vocab_size(), str(garbage.get("mode", "out_of_range")))
        return result

    def channel_handlers(self) -> dict[str, Handler]:
        """The round's hot path (specserve_types/round_channel.py): `propose`, as Serve would call it."""
        return {"propose": self.propose_soon}

    def channel_reader(self) -> ComputeThread:
        """The compute thread reads the channel's frames itself: a round's request wakes the thread that runs it."""
        return self.compute

    def vocab_size(self) -> int:
        return self.worker.config.vocab_size


def garbage_drafts(result: ProposeResult, vocab_size: int, mode: str) -> ProposeResult:
    """The drafter lying (a chaos fault): ids outside the vocabulary, or one draft more than asked."""
    outputs = []
    for out in result.outputs:
        if mode == "wrong_length":
            ids = [*out.draft_ids, out.draft_ids[-1] if out.draft_ids else 0]
            probs = out.draft_probs
            if probs is not None and len(probs):
                probs = np.concatenate([probs, probs[-1:]])
        else:
            ids, probs = [vocab_size + 7 + i for i in range(len(out.draft_ids))], out.draft_probs
        outputs.append(ProposeOutput(out.request_id, ids, probs))
    return ProposeResult(outputs, result.seconds, result.worker_instance)


DrafterDeployment = serve.deployment(Drafter, name="Drafter")
