"""The engine of the cluster: SpecEngine with remote backends, built inside the Scheduler replica.

    SpecEngine --propose--> HandleDrafter  -> Drafter deployment (DeploymentHandle)
               --verify-->  HandleVerifier -> Verifier deployment (DeploymentHandle)
               <--kv-->     RemoteKV       -> KVManagerActor (a Ray actor owned by the scheduler replica)

All three adapters block; they are called only from the engine thread (cluster/serving/engine_loop.py; the
drafter's also from the engine's draft thread), never from an event loop. With `round_transport: channel`
(the default) each round's call goes over the worker's round channel (specserve_types/round_channel.py): the
adapter asks the worker for its endpoint through Ray once, and again only after the connection broke (a
replaced worker, a restarted actor); a broken connection is a failed call, as a dead replica's Ray call is.
With `round_transport: ray` every call is a Serve handle or actor call.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from cluster.engine.backends import DrafterUnavailable
from cluster.engine.engine import SpecEngine
from cluster.engine.step_record import EngineObserver
from cluster.serving.config import ClusterConfig
from kv_manager.errors import KVError, RetriableKVError, UnknownRequest
from kv_manager.schema import (
    Admission,
    AdmitItem,
    AuditReport,
    CommitItem,
    CommitResult,
    Holder,
    Reservation,
    ReserveItem,
)
from specserve_types.ray_channel import link_to
from specserve_types.round_channel import ChannelLost, ChannelTimeout
from specserve_types.round_channel_client import ChannelLink, PendingCall
from specserve_types.round_messages import ProposeBatch, ProposeResult, VerifyBatch, VerifyResult
from specserve_types.tracing import CURRENT_CARRIER

log = logging.getLogger("specserve.cluster")


def serve_link(handle: Any, timeout_s: float | None) -> ChannelLink:
    """A round-channel link to a deployment's replica (Serve's router picks it, waiting for a live one)."""
    return link_to(lambda: handle.channel.remote().result(timeout_s=timeout_s))


class HandleVerifier:
    """`on_sent`, when set (once, by the engine loop before the first round: EngineLoop.hold_chunks_until), runs
    on the engine thread once each verify request is on its way: the last round's chunks are handed to the event
    loop then, so that it streams them while the verifier computes."""

    def __init__(self, handle: Any, timeout_s: float | None = None, transport: str = "channel") -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        self.link = serve_link(handle, timeout_s) if transport == "channel" else None
        self.on_sent: Callable[[], None] | None = None

    def verify(self, batch: VerifyBatch, on_sent: Callable[[], None] | None = None) -> VerifyResult:
        hooks = [hook for hook in (on_sent, self.on_sent) if hook is not None]

        def sent() -> None:
            for hook in hooks:
                hook()

        if self.link is not None:
            return self.link.call("verify", batch, timeout_s=self.timeout_s, on_sent=sent)
        response = self.handle.verify.remote(batch)
        sent()
        return response.result(timeout_s=self.timeout_s)


class HandleDrafter:
    """Serve's router waits for a live replica without limit (a killed replica's calls are re-routed to
    its replacement), so an unanswered propose call is cancelled after `timeout_s` and raised as
    DrafterUnavailable: the engine decodes plainly meanwhile instead of stalling every request. `on_sent`, when set
    (as HandleVerifier's), runs on the calling thread once each propose request is on its way."""

    def __init__(self, handle: Any, timeout_s: float | None = None, transport: str = "channel") -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        self.link = serve_link(handle, timeout_s) if transport == "channel" else None
        self.on_sent: Callable[[], None] | None = None

    def propose(self, batch: ProposeBatch) -> ProposeResult:
        if self.link is not None:
            try:
                return self.link.call("propose", batch, timeout_s=self.timeout_s, on_sent=self.on_sent)
            except (ChannelTimeout, TimeoutError):  # the call, or finding a live replica
                raise DrafterUnavailable(f"no drafter answer within {self.timeout_s}s") from None
        response = self.handle.propose.remote(batch)
        if self.on_sent is not None:
            self.on_sent()
        try:
            return response.result(timeout_s=self.timeout_s)
        except TimeoutError:
            response.cancel()
            raise DrafterUnavailable(f"no drafter answer within {self.timeout_s}s") from None


class RemoteKV:
    """LocalKV's methods (cluster/engine/kv_client.py) over the KV manager actor, synchronously.

    This engine is the ledger's only client (build_cluster_engine creates the actor for it), so the
    free fractions change only through its own calls: `reserve`, `commit` and `commit_then_reserve`
    bring them back with their answers, any other mutating call marks them stale, and `free_fraction`
    fetches only then.
    """

    def __init__(self, actor: Any, timeout_s: float = 60.0, transport: str = "channel") -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self.incarnation: str = ray.get(actor.incarnation.remote(), timeout=timeout_s)
        self._free: dict[str, float] | None = None  # None = stale
        self._free_lock = threading.Lock()  # the engine calls from one thread; tests share a client across threads
        self.link = link_to(lambda: ray.get(actor.channel.remote(), timeout=timeout_s)) if transport == "channel" \
            else None
        # the ahead calls' own connection (channel) or thread (Ray path): they run beside the verify (their totals
        # apart: off the round's path)
        self.ahead_link = link_to(lambda: ray.get(actor.channel.remote(), timeout=timeout_s)) \
            if transport == "channel" else None
        self._ahead = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-ahead") \
            if self.ahead_link is None else None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.link is not None:
            try:
                return self.link.call(method, self.incarnation, *args, timeout_s=self.timeout_s, **kwargs)
            except (ChannelLost, RayActorError) as lost:  # the actor died (or is restarting): this call is void
                raise RetriableKVError(f"kv manager lost during {method}: {lost}") from lost
        try:
            return ray.get(getattr(self.actor, method).remote(self.incarnation, *args, **kwargs),
                           timeout=self.timeout_s)
        except RayTaskError as failure:
            if isinstance(failure.cause, KVError):
                raise failure.cause from None
            raise
        except RayActorError as lost:
            raise RetriableKVError(f"kv manager lost during {method}: {lost}") from lost

    def _mutating(self, method: str, *args: Any) -> Any:
        try:
            return self._call(method, *args)
        finally:
            self._free = None

    def _reporting(self, method: str, *args: Any) -> Any:
        """A call whose answer ends with the free fractions after it (the `*_with_free` methods)."""
        return self._reported(method, lambda: self._call(method, *args, **_trace_kwargs()))

    def _reported(self, method: str, answer_of: Callable[[], Any]) -> Any:
        """A `*_with_free` answer: the free fractions kept (stale after a failure), a lost actor raised as
        RetriableKVError."""
        try:
            *answer, free = answer_of()
        except (ChannelLost, RayActorError) as lost:
            self._free = None
            raise RetriableKVError(f"kv manager lost during {method}: {lost}") from lost
        except BaseException:
            self._free = None
            raise
        self._free = free
        return answer[0] if len(answer) == 1 else tuple(answer)

    def register_worker(self, worker_id: str) -> Holder:
        return self._mutating("register_worker", worker_id)

    def expire_worker(self, worker_id: str) -> int:
        return self._mutating("expire_worker", worker_id)

    def can_admit(self, items: Sequence[AdmitItem], lookahead: int) -> bool:
        return self._call("can_admit", {i.namespace: len(i.prompt_token_ids) + lookahead for i in items})

    def admit(self, items: Sequence[AdmitItem]) -> list[Admission]:
        return self._all_or_nothing("add_requests", list(items))

    def fork(self, items: Sequence[tuple[str, str, str]]) -> list[Admission]:
        return self._all_or_nothing("forks", list(items))

    def _all_or_nothing(self, method: str, items: list[Any]) -> list[Admission]:
        """One actor call making an entry per item; a refusal releases the entries the same call made."""
        outcomes = self._mutating(method, items)
        refusals = [o for o in outcomes if isinstance(o, KVError)]
        if refusals:
            done = [(o.namespace, o.request_id) for o in outcomes if not isinstance(o, KVError)]
            if done:
                self._mutating("release", done)
            raise refusals[0]
        return outcomes

    def reserve(self, items: Sequence[ReserveItem]) -> list[Reservation | KVError]:
        return self._reporting("reserve_with_free", list(items), False)

    def commit(self, items: Sequence[CommitItem]) -> list[CommitResult | KVError]:
        return self._reporting("commit_with_free", list(items))

    def commit_then_reserve(self, commits: Sequence[CommitItem], reserves: Sequence[ReserveItem]
                            ) -> tuple[list[CommitResult | KVError], list[Reservation | KVError]]:
        return self._reporting("commit_then_reserve_with_free", list(commits), list(reserves))

    def commit_then_reserve_ahead(self, commits: Sequence[CommitItem], reserves: Sequence[ReserveItem]) -> Any:
        """`commit_then_reserve`, sent now on its own connection and answered by `result()` (the caller's thread
        makes no other ledger call in between: the engine waits for its verify). On the Ray path: an actor call on
        a thread of its own."""
        method, args = "commit_then_reserve_with_free", (list(commits), list(reserves))
        if self._ahead is not None:
            context = contextvars.copy_context()  # the caller's trace context goes along
            return self._ahead.submit(context.run, self._reporting, method, *args)
        assert self.ahead_link is not None
        try:
            pending = self.ahead_link.send(method, self.incarnation, *args, timeout_s=self.timeout_s,
                                           **_trace_kwargs())
        except ChannelLost as lost:
            self._free = None
            raise RetriableKVError(f"kv manager lost during {method}: {lost}") from lost
        return _Reported(self, method, pending)

    def rollback(self, keys: Sequence[tuple[str, str]]) -> None:
        self._raise_unexpected(self._mutating("rollback", list(keys)))

    def release(self, request_id: str, namespaces: Sequence[str]) -> None:
        self._raise_unexpected(self._mutating("release", [(namespace, request_id) for namespace in namespaces]))

    def free_fraction(self, namespace: str) -> float:
        with self._free_lock:
            free = self._free
            if free is None:
                free = self._free = self._call("free_fractions")
            return free[namespace]

    def request_ids(self, namespace: str) -> list[str]:
        return self._call("request_ids", namespace)

    def audit(self) -> AuditReport:
        return self._call("audit")

    def ledger_lost(self) -> bool:
        """True once the actor restarted (a new incarnation: its ledger is empty, so every call of this client
        is refused from now on) or died for good; False while it answers, or is being restarted."""
        try:
            return ray.get(self.actor.incarnation.remote(), timeout=self.timeout_s) != self.incarnation
        except ActorDiedError:
            return True
        except (RayActorError, ray.exceptions.GetTimeoutError):
            return False

    @staticmethod
    def _raise_unexpected(outcomes: list[Any]) -> None:
        for outcome in outcomes:  # an unknown request is already gone: nothing to give back
            if isinstance(outcome, KVError) and not isinstance(outcome, UnknownRequest):
                raise outcome


def _trace_kwargs() -> dict[str, Any]:
    carrier = CURRENT_CARRIER.get()  # a traced step's: the actor continues its trace
    return {"trace_context": carrier} if carrier else {}


class _Reported:
    """An ahead ledger call's answer, read as `RemoteKV._reporting` reads one (`RemoteKV._reported`)."""

    def __init__(self, kv: RemoteKV, method: str, pending: PendingCall) -> None:
        self.kv = kv
        self.method = method
        self.pending = pending

    def result(self) -> Any:
        return self.kv._reported(self.method, self.pending.result)


def transport_totals(engine: Any) -> dict[str, Any]:
    """The round channels' totals of a cluster engine (calls, round trip, handler and transport seconds per
    worker); {"kind": "ray"} where the rounds go through Serve and actor calls."""
    kv = getattr(engine, "kv", None)
    inner_kv = getattr(kv, "inner", kv)  # HeldCommitKV wraps the RemoteKV
    backends = {"verifier": getattr(engine, "verifier", None), "drafter": getattr(engine, "drafter", None),
                "kv": inner_kv}
    links = {name: getattr(backend, "link", None) for name, backend in backends.items()}
    links["kv_ahead"] = getattr(inner_kv, "ahead_link", None)  # beside the verify: off the round's path
    if all(link is None for link in links.values()):
        return {"kind": "ray"}
    return {"kind": "channel", **{name: link.totals().to_dict() for name, link in links.items() if link is not None}}


def build_cluster_engine(config: ClusterConfig, drafter: Any, verifier: Any,
                         observer: EngineObserver | None = None) -> SpecEngine:
    """The scheduler's engine: remote workers, the KV manager actor, the target's tokenizer, its observer."""
    from cluster.engine.factory import assemble_engine, model_dir
    from kv_manager.actor import KVManagerActor
    from model_runtime.precision import draft_dtype, dtype_name, target_dtype

    log.info("cluster engine: target %s, draft %s, max_batch %d", config.model, config.draft, config.max_batch)
    env = config.tracing_settings().env()  # the actor continues traced steps (kv_manager/actor.py `traced`)
    kv_tracing: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
    transport = config.round_transport
    engine = assemble_engine(
        config.model, config.draft, config.engine_config(in_process=False), config.kv_pool_blocks,
        config.block_size, make_verifier=lambda _dir: HandleVerifier(verifier, transport=transport),
        make_drafter=(lambda _dir: HandleDrafter(drafter, config.drafter_timeout_s, transport))
        if drafter is not None else None,
        make_kv=lambda namespaces: RemoteKV(KVManagerActor.options(
            name=None, **config.placement.kv_manager.actor_options(), **kv_tracing).remote(namespaces),
            transport=transport),
        # resolved as the workers resolve them (same function, same device name; a node pool of one CPU type)
        dtypes={"target": dtype_name(target_dtype(config.dtype, config.device, model_dir(config.model),
                                                  config.tensor_parallel_size, config.max_batch)),
                "draft": dtype_name(draft_dtype(config.draft_dtype, config.device,
                                                model_dir(config.draft) if drafter is not None else None))},
        observer=observer,
    )
    if config.warm_up:
        from cluster.engine.warmup import warm_up

        if drafter is not None:
            wait_for_drafter(drafter, DRAFTER_STARTUP_TIMEOUT_S)
        warm_up(engine)
    return engine


# how long the scheduler's warm-up waits for the drafter's replica to come up (it loads its model beside the
# verifier's: ~65 s for the Qwen pair on 2 vCPUs)
DRAFTER_STARTUP_TIMEOUT_S = 300.0


def wait_for_drafter(handle: Any, timeout_s: float) -> bool:
    """Block until the drafter deployment has a live replica (its `vocab_size` answers), up to `timeout_s`. The
    warm-up times the draft step and the verify of every k through the drafter; started while the drafter was still
    loading, its propose calls outran `drafter_timeout_s`, the drafter was marked failed, and the warm-up ran plain:
    no draft cost measured, the first users' rounds drafting at a guessed k and timing cold calls (the Qwen pair:
    a draft step of 64 ms against 29 ms in process, so the cluster's auto drafted half as often). False, with a
    warning, where it did not come up in time or its call failed: the warm-up then runs as before (the engine
    falls back to plain decoding while the drafter is down) and auto learns the draft's cost from live rounds."""
    try:
        handle.vocab_size.remote().result(timeout_s=timeout_s)
        return True
    except TimeoutError:
        log.warning("no drafter replica within %.0f s: warming up without it", timeout_s)
    except Exception as exc:  # noqa: BLE001 - a drafter down at startup is the engine's fallback to handle, not ours
        log.warning("the drafter did not answer (%r): warming up without it", exc)
    return False
