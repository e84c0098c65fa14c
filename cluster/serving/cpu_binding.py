"""CPUs of their own for the model processes' compute threads on a local Ray node, the rest for everything else.

On a small CPU node the verifier's forward shares the cores with a dozen other processes: Ray's daemons, Serve's
controller and proxy, the ingress, the scheduler, the KV ledger, the benchmark's client. Each wakes many times a
round, and the kernel puts a woken thread on the busy core as often as on the idle one: measured on a 2-vCPU Xeon
(`bench serve --threads 1`, 2026-12-03), the verifier's compute thread was preempted ~220 times per CPU-second
(the in-process engine's thread: ~13), and its forward ran 7-9% slower than the same forward in process. With
the compute thread alone on its CPU and everything else on the other, the same run's verify fell from ~60 to ~48
ms a round. llama.cpp (`--cpu-mask`, `--prio`) and vLLM's CPU backend (`VLLM_CPU_OMP_THREADS_BIND`) bind their
compute threads the same way.

    CPUs (this process's affinity mask)    0 .. n-1
    compute: verifier rank r               the last threads CPUs, rank 0 last
             drafter                       rank 0's CPUs (it drafts while the verifier waits), or CPUs of its
                                           own when it drafts beside the verifier (overlap)
    service: everything else               the CPUs left (at least one); a local Ray starts on them

The trade: Ray's processes and a replacement replica start on the service CPUs only. With one left (2 vCPUs,
`worker_threads: 1`), a killed scheduler's replacement took 19 s to its first success against 11.5 s unbound
(`specserve chaos run --scenario scheduler-kill`, 2026-12-03). So `cpu_binding: auto` (the default) gives the rest
CPUs of its own only where at least AUTO_SERVICE_CPUS are left; with fewer it pins the compute threads alone and
lets everything else run on every CPU (`CpuPlan.shared`): the forward never migrates and a replacement starts on
all the cores. `on` keeps the rest off the compute CPUs wherever one CPU is left for it.

    auto, 2 vCPUs, 1 model thread    verifier rank 0: CPU 1; everything else: CPU 0,1 (shared)
    on,   2 vCPUs, 1 model thread    verifier rank 0: CPU 1; everything else: CPU 0
    auto, 8 vCPUs, 2 model threads   verifier rank 0: CPU 6,7; everything else: CPU 0-5

A plan exists only where the CPUs are this node's to give: a local Ray that our command starts (`specserve up`
without `ray_address`, `bench serve`, chaos runs), a mask no larger than the cgroup quota (a pod sharing a node's
cores under a quota gets no plan: pinning there would put two pods' threads on one core), and more CPUs than the
model threads need. Otherwise None, and nothing is bound. No Ray, no torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from cluster.serving.cpu_quota import available_cpus

__all__ = ["AUTO_SERVICE_CPUS", "CpuPlan", "own_cpus", "plan_cpus", "thread_cpus"]

AUTO_SERVICE_CPUS = 2  # `cpu_binding: auto` keeps the rest off the compute CPUs only where this many are left to it


@dataclass(frozen=True)
class CpuPlan:
    """Which CPUs each compute thread and everything else may use (sorted tuples of CPU ids)."""

    service: tuple[int, ...]  # everything else (a local Ray's processes, the command's own threads)
    ranks: tuple[tuple[int, ...], ...]  # verifier TP rank r's compute thread
    drafter: tuple[int, ...] | None  # the draft model's compute thread; None: no draft model
    shared: bool = False  # True: `service` is every CPU, the compute ones included (only the compute threads pinned)

    def describe(self) -> str:
        parts = [f"verifier rank {r}: {_cpus(c)}" for r, c in enumerate(self.ranks)]
        if self.drafter is not None:
            parts.append(f"drafter: {_cpus(self.drafter)}")
        return "; ".join([*parts, f"everything else: {_cpus(self.service)}" + (" (shared)" if self.shared else "")])

    def sharing(self) -> CpuPlan:
        """The same compute CPUs, with everything else on every CPU (theirs included)."""
        every = {*self.service, *(c for rank in self.ranks for c in rank), *(self.drafter or ())}
        return replace(self, service=tuple(sorted(every)), shared=True)


def _cpus(cpus: Sequence[int]) -> str:
    return "CPU " + ",".join(str(c) for c in cpus)


def plan_cpus(cpus: Sequence[int], rank_threads: int, ranks: int = 1, drafter_threads: int | None = None,
              drafter_beside: bool = False) -> CpuPlan | None:
    """Compute CPUs from the end of `cpus`, `rank_threads` per verifier rank, then the drafter's if it drafts beside
    the verifier; None if that leaves no CPU for the rest."""
    if rank_threads < 1 or ranks < 1:
        raise ValueError(f"rank_threads and ranks must be >= 1, got {rank_threads}, {ranks}")
    order = sorted(set(cpus))
    own_drafter = drafter_threads is not None and drafter_beside
    needed = rank_threads * ranks + (drafter_threads if own_drafter and drafter_threads else 0)
    if needed >= len(order):
        return None
    free = list(order)

    def take(n: int) -> tuple[int, ...]:
        taken = free[-n:]
        del free[-n:]
        return tuple(sorted(taken))

    rank_cpus = tuple(take(rank_threads) for _ in range(ranks))
    drafter: tuple[int, ...] | None = None
    if drafter_threads is not None:
        drafter = take(drafter_threads) if drafter_beside else rank_cpus[0]
    return CpuPlan(service=tuple(free), ranks=rank_cpus, drafter=drafter)


def own_cpus() -> list[int] | None:
    """This process's CPUs if they are its own to hand out: its affinity mask, when no cgroup quota is below the
    mask's size (else the cores are shared with other cgroups); None where there is no affinity API."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    mask = sorted(os.sched_getaffinity(0))
    return mask if available_cpus() == len(mask) else None  # a quota below the mask caps available_cpus


@contextlib.contextmanager
def thread_cpus(cpus: Sequence[int] | None) -> Iterator[None]:
    """The calling thread (and the threads and processes it starts meanwhile) on `cpus`; its mask restored after.
    None: unchanged."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
