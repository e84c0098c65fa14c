"""The Verifier deployment: one replica hosts a VerifierWorker over the target model's TP ranks.

    scheduler --VerifyBatch--> Verifier.verify --> VerifierWorker --forward--> TP ranks (rank 0 answers)

TP = 1: the replica itself holds the model and its KV pool (`LocalRunner`), owned by the replica's
`ComputeThread` (loading and every forward run there, never on Serve's request threads).
TP > 1: the replica's placement group has one bundle for itself plus one per rank; each rank is a
Ray actor (`TPRankActor`) in its own bundle holding its weight shard and KV-pool shard. The ranks
join one torch.distributed group (gloo on CPU, rendezvous at rank 0's node) and run every forward
together (SPMD); the replica fans each batch out over a round channel per rank (specserve_types/round_channel.py;
Ray calls with `round_transport: ray`) and takes rank 0's logits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from collections.abc import Sequence
from typing import Any

import ray
import torch
from ray import serve
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from model_runtime.batch import SeqInput
from model_runtime.compute_thread import ComputeThread, bind_thread
from model_runtime.graph.modes import CaptureSettings
from specserve_types.faults import FAULTS, FaultHooks, InjectedFault
from specserve_types.ray_channel import ChannelHost, link_to
from specserve_types.round_channel import Handler
from specserve_types.round_messages import VerifyBatch, VerifyResult
from specserve_types.tracing import TracingSettings, configure_tracing, tracing_enabled, worker_span
from verifier_service.worker import LocalRunner, VerifierWorker

logger = logging.getLogger("ray.serve")

RANK_CPUS = 1.0  # per TP rank bundle
DRIVER_CPUS = 0.1  # the replica's own bundle when TP > 1


def worker_device(device: str) -> str:
    """The torch device inside a worker: Ray makes the assigned GPU the only visible one (cuda:0)."""
    return "cuda:0" if device.startswith("cuda") else device


def placement_bundles(tensor_parallel_size: int, gpus_per_rank: float = 0.0) -> list[dict[str, float]] | None:
    """Serve placement-group bundles for the Verifier: None for TP = 1 (no group needed)."""
    if tensor_parallel_size == 1:
        return None
    rank = {"CPU": RANK_CPUS, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
    return [{"CPU": DRIVER_CPUS}] + [rank] * tensor_parallel_size


class TPRankActor(ChannelHost):
    """One tensor-parallel rank: its shard of the weights and of the paged KV pool. `forward` also over a round
    channel (the replica's fan-out: no Ray task, no object store for rank 0's logits); one caller at a time."""

    def __init__(self, rank: int, world_size: int, worker_threads: int, cpus: Sequence[int] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.worker_threads = worker_threads
        self.cpus = cpus  # this rank's compute CPUs (cluster/serving/cpu_binding.py); None: unbound
        self.tp_rank: Any = None
        self._sized_threads: set[int] = set()  # threads whose CPUs and torch thread count are set
        self._size_thread()

    def _size_thread(self) -> None:
        """The calling thread on this rank's CPUs with its torch thread count (each thread that computes: setup's,
        then a channel's connection thread)."""
        if threading.get_ident() in self._sized_threads:
            return
        if self.cpus:
            bind_thread(f"TP rank {self.rank}", self.cpus)
        if self.worker_threads > 0:
            torch.set_num_threads(self.worker_threads)
        self._sized_threads.add(threading.get_ident())

    def channel_handlers(self) -> dict[str, Handler]:
        return {"forward": self.forward}

    def rendezvous_address(self) -> str:
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        return f"tcp://{host}:{port}"

    def setup(self, init_method: str, checkpoint_dir: str, num_blocks: int, block_size: int, device: str,
              dtype: torch.dtype) -> int:
        from model_runtime.tp import TPRank, init_tp_group

        init_tp_group(self.rank, self.world_size, init_method, device)
        self.tp_rank = TPRank(checkpoint_dir, self.rank, self.world_size, num_blocks, block_size, device, dtype)
        return self.tp_rank.model.config.vocab_size

    def forward(self, seqs: list[SeqInput], copy_blocks: list[tuple[int, int]],
                slot_moves: tuple[tuple[int, int], ...] = ()) -> list[torch.Tensor] | None:
        self._size_thread()  # a channel's connection thread the first time
        self.tp_rank.kv.move_slots(list(slot_moves))  # the last round's accepted tree paths first
        self.tp_rank.kv.copy_blocks(copy_blocks)
        logits = self.tp_rank.forward(seqs)
        return logits if self.rank == 0 else None  # only rank 0's answer travels back


class TPGroupRunner:
    """ForwardRunner over `world_size` rank actors in the replica's placement group."""

    def __init__(self, checkpoint_dir: str, world_size: int, num_blocks: int, block_size: int, device: str,
                 worker_threads: int, gpus_per_rank: float, dtype: torch.dtype, transport: str = "channel",
                 rank_cpus: Sequence[Sequence[int]] | None = None) -> None:
        from model_runtime.config import ModelConfig

        self.config = ModelConfig.from_dir(checkpoint_dir)
        self.config.check_tensor_parallel(world_size)
        group = get_current_placement_group()
        actor_cls = ray.remote(TPRankActor)
        self.ranks = []
        for rank in range(world_size):
            options: dict[str, Any] = {"num_cpus": RANK_CPUS if group is not None else 0, "num_gpus": gpus_per_rank}
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=1 + rank)
            cpus = list(rank_cpus[rank]) if rank_cpus else None
            self.ranks.append(actor_cls.options(**options).remote(rank, world_size, worker_threads, cpus))
        init_method = ray.get(self.ranks[0].rendezvous_address.remote())
        ray.get([r.setup.remote(init_method, checkpoint_dir, num_blocks, block_size, worker_device(device), dtype)
                 for r in self.ranks])
        # round channels to the ranks (specserve_types/round_channel.py); None: Ray calls
        self.links = [link_to(lambda r=r: ray.get(r.channel.remote())) for r in self.ranks] \
            if transport == "channel" else None
        self._fan_out = concurrent.futures.ThreadPoolExecutor(max(1, world_size - 1), thread_name_prefix="tp-fan-out")
        logger.info("verifier TP group ready: %d ranks, rendezvous %s, %s transport", world_size, init_method,
                    transport)

    def forward(self, seqs: list[SeqInput], copy_blocks: list[tuple[int, int]],
                slot_moves: tuple[tuple[int, int], ...] = ()) -> list[torch.Tensor]:
        if self.links is None:
            refs = [rank.forward.remote(seqs, copy_blocks, slot_moves) for rank in self.ranks]
            results = ray.get(refs)  # every rank must finish: an error on any rank fails the round
            return results[0]
        others = [self._fan_out.submit(link.call, "forward", seqs, copy_blocks, slot_moves) for link in self.links[1:]]
        logits = self.links[0].call("forward", seqs, copy_blocks, slot_moves)  # raises at once if rank 0 fails
        for other in others:
            other.result()  # every rank must finish: an error on any rank fails the round
        return logits

    def shutdown(self) -> None:
        for link in self.links or []:
            link.close()
        self._fan_out.shutdown(wait=False)
        for rank in self.ranks:
            ray.kill(rank)


class Verifier(FaultHooks, ChannelHost):
    def __init__(self, model: str, num_blocks: int, block_size: int, device: str = "cpu",
                 tensor_parallel_size: int = 1, worker_threads: int = 0, gpus_per_rank: float = 0.0,
                 dtype: str = "auto", round_transport: str = "channel",
                 rank_cpus: Sequence[Sequence[int]] | None = None, max_batch: int | None = None,
                 capture: CaptureSettings | None = None) -> None:
        """`rank_cpus`: each TP rank's compute CPUs on a local node (cluster/serving/cpu_binding.py); None: unbound.
        `max_batch`: the engine's (auto's dtype reads it: model_runtime/precision.py). `capture`: the config's
        (model_runtime/graph/modes.py), resolved here against the device, the ranks and the precision; None: off."""
        from model_runtime.config import ModelConfig
        from model_runtime.precision import dtype_name, target_dtype
        from model_runtime.prepare import prepare_model

        # owns the runner and its KV pool; with TP > 1 it only drives the ranks (no CPUs of its own)
        self.compute = ComputeThread("verifier-compute", worker_threads,
                                     rank_cpus[0] if rank_cpus and tensor_parallel_size == 1 else None)
        checkpoint = str(prepare_model(model, progress=False))
        precision = target_dtype(dtype, worker_device(device), checkpoint, tensor_parallel_size, max_batch)
        plan = (capture or CaptureSettings()).plan(worker_device(device), tensor_parallel_size, dtype_name(precision),
                                                   block_size, ModelConfig.from_dir(checkpoint).max_position_embeddings)
        if tensor_parallel_size == 1:  # a plan: every bucket captured on the compute thread, before serving
            self.runner: Any = self.compute.call(LocalRunner, checkpoint, num_blocks, block_size,
                                                 worker_device(device), precision, plan)
            self.compute.call(self.runner.warm_up, block_size)  # a replacement's first verify is not a cold start
        else:
            self.runner = TPGroupRunner(checkpoint, tensor_parallel_size, num_blocks, block_size, device,
                                        worker_threads, gpus_per_rank, precision, round_transport, rank_cpus)
        self.worker = VerifierWorker(self.runner)
        self.tensor_parallel_size = tensor_parallel_size
        configure_tracing(TracingSettings.from_env(), "specserve-verifier")  # env set by the app (runtime_env)
        logger.info("verifier ready: %s (%s), TP=%d, %d KV blocks of %d, forward %s", model, precision,
                    tensor_parallel_size, num_blocks, block_size,
                    self.runner.rank.forward_kind if tensor_parallel_size == 1 else "eager")

    async def verify(self, batch: VerifyBatch) -> VerifyResult:
        """Through Serve (`round_transport: ray`)."""
        return await asyncio.to_thread(lambda: self.verify_soon(batch).result())

    def verify_soon(self, batch: VerifyBatch) -> concurrent.futures.Future[VerifyResult]:
        """One round's verify, queued on the compute thread (the round channel's handler: the compute thread
        sends the answer as the forward ends). An injected latency delays the answer,
        not the compute thread (which may be the one calling: it reads the channel's connections)."""
        if FAULTS.active and (delay := FAULTS.take("verifier.latency")) is not None:
            return self.compute.submit_after(float(delay.get("seconds", 1.0)), self._verify, batch)
        return self.compute.submit(self._verify, batch)

    def _verify(self, batch: VerifyBatch) -> VerifyResult:
        """On the compute thread."""
        if batch.trace_context and tracing_enabled():  # the round's trace continues here (specserve_types/tracing.py)
            with worker_span("verifier.verify", batch.trace_context, len(batch.items)):
                return self._faulty_verify(batch)
        return self._faulty_verify(batch)

    def _faulty_verify(self, batch: VerifyBatch) -> VerifyResult:
        result = self.worker.verify(batch)
        if FAULTS.active and FAULTS.take("verifier.raise") is not None:  # after the forward wrote the KV pool: mid-round
            raise InjectedFault("verifier raised mid-forward (injected)")
        return result

    def channel_handlers(self) -> dict[str, Handler]:
        """The round's hot path (specserve_types/round_channel.py): `verify`, as Serve would call it."""
        return {"verify": self.verify_soon}

    def rank_actors(self) -> list[Any]:
        """The TP rank actors' handles (chaos runs kill one); empty with TP = 1."""
        return list(self.runner.ranks) if isinstance(self.runner, TPGroupRunner) else []

    def channel_reader(self) -> ComputeThread:
        """The compute thread reads the channel's frames itself: a round's request wakes the thread that runs it."""
        return self.compute

    def vocab_size(self) -> int:
        return self.worker.config.vocab_size

    def __del__(self) -> None:
        if isinstance(getattr(self, "runner", None), TPGroupRunner):
            self.runner.shutdown()


VerifierDeployment = serve.deployment(Verifier, name="Verifier")
