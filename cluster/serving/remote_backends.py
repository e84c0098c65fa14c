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
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.engine.backends import DrafterUnavailable
from cluster.engine.engine import SpecEngine
from cluster.engine.step_record import EngineObserver
from cluster.serving.config import ClusterConfig
from kv_manager.errors import KVError, LedgerRestarted, RetriableKVError, UnknownRequest
from kv_manager.live_state import LiveRecord
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


class _Lost(Exception):
    """This call reached no ledger of this client's incarnation: the actor died during it, or restarted before it
    (the cause says which). `RemoteKV._call` rebuilds the ledger and calls again."""


class RemoteKV:
    """LocalKV's methods (cluster/engine/kv_client.py) over the KV manager actor, synchronously.

    This engine is the ledger's only client (build_cluster_engine creates the actor for it), so the
    free fractions change only through its own calls: `reserve`, `commit` and `commit_then_reserve`
    bring them back with their answers, any other mutating call marks them stale, and `free_fraction`
    fetches only then.

    A restarted actor loses nothing (docs/ARCHITECTURE.md §6): every answer is also applied to `live` (a
    LiveRecord: the ledger as its answers left it), and a call that finds the actor dead or restarted waits for
    the new instance, has it rebuild its ledger from `live` (`recover`, kv_manager/rebuild.py) and is sent again.
    The engine sees one slow call. Only an actor dead for good, one not back within `recovery_timeout_s`, or a
    rebuild it refuses raise RetriableKVError (the round fails, and the health check's `ledger_lost` replaces
    the scheduler replica).
    """

    def __init__(self, actor: Any, timeout_s: float = 60.0, transport: str = "channel",
                 recovery_timeout_s: float = 120.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self.recovery_timeout_s = recovery_timeout_s
        self.incarnation: str = ray.get(actor.incarnation.remote(), timeout=timeout_s)
        self.live = LiveRecord()
        self.rebuilds: list[dict[str, Any]] = []  # each recovery: when, why, how long, how many entries
        self._recovery = threading.Lock()
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

    def _call_once(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.link is not None:
            try:
                return self.link.call(method, self.incarnation, *args, timeout_s=self.timeout_s, **kwargs)
            except (ChannelLost, RayActorError, LedgerRestarted) as lost:  # this call is void
                raise _Lost(f"{method}: {lost!r}") from lost
        try:
            return ray.get(getattr(self.actor, method).remote(self.incarnation, *args, **kwargs),
                           timeout=self.timeout_s)
        except RayTaskError as failure:
            if isinstance(failure.cause, LedgerRestarted):
                raise _Lost(f"{method}: {failure.cause!r}") from None
            if isinstance(failure.cause, KVError):
                raise failure.cause from None
            raise
        except RayActorError as lost:
            raise _Lost(f"{method}: {lost!r}") from lost

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One ledger call; where it reached no ledger, the ledger is rebuilt and the call sent once more."""
        try:
            return self._call_once(method, *args, **kwargs)
        except _Lost as lost:
            self.recover(str(lost))
        try:
            return self._call_once(method, *args, **kwargs)
        except _Lost as lost:
            raise RetriableKVError(f"kv manager lost again right after its rebuild: {lost}") from lost

    def recover(self, reason: str) -> None:
        """Wait for the actor to answer (Ray restarts it), then have it rebuild its ledger from `live`; the new
        incarnation is this client's from then on. Raises RetriableKVError where the actor is dead for good, is
        not back within `recovery_timeout_s`, or refuses the state."""
        with self._recovery:
            start = time.monotonic()
            deadline = start + self.recovery_timeout_s
            while True:
                try:
                    ray.get(self.actor.incarnation.remote(), timeout=max(0.1, min(self.timeout_s,
                                                                               deadline - time.monotonic())))
                    break
                except (RayActorError, GetTimeoutError) as exc:
                    if actor_dead_for_good(self.actor):
                        raise RetriableKVError(f"kv manager dead for good ({reason})") from exc
                    if time.monotonic() >= deadline:
                        raise RetriableKVError(f"kv manager not back within {self.recovery_timeout_s:.0f} s "
                                               f"({reason})") from exc
                    time.sleep(0.1)  # a call sent to the dead instance before Ray knew: ask again
            live = self.live.state()
            try:
                self.incarnation = ray.get(self.actor.rebuild.remote(live), timeout=self.timeout_s)
            except (RayTaskError, RayActorError, GetTimeoutError) as failure:
                raise RetriableKVError(f"kv manager's rebuild failed ({reason}): {failure!r}") from failure
            self._free = None
            for link in (self.link, self.ahead_link):  # connected to the old instance: the next call reconnects
                if link is not None:
                    link.close()
            seconds = time.monotonic() - start
            self.rebuilds.append({"at": time.time(), "reason": reason, "seconds": round(seconds, 3),
                                  "entries": len(live.entries)})
            log.warning("kv manager lost (%s): ledger rebuilt from %d live entries in %.2f s", reason,
                        len(live.entries), seconds)

    def _mutating(self, method: str, *args: Any) -> Any:
        try:
            return self._call(method, *args)
        finally:
            self._free = None

    def _reporting(self, method: str, *args: Any) -> Any:
        """A call whose answer ends with the free fractions after it (the `*_with_free` methods)."""
        return self._reported(lambda: self._call(method, *args, **_trace_kwargs()))

    def _reported(self, answer_of: Callable[[], Any]) -> Any:
        """A `*_with_free` answer: the free fractions kept (stale after a failure)."""
        try:
            *answer, free = answer_of()
        except BaseException:
            self._free = None
            raise
        self._free = free
        return answer[0] if len(answer) == 1 else tuple(answer)

    def register_worker(self, worker_id: str) -> Holder:
        holder = self._mutating("register_worker", worker_id)
        self.live.registered(holder)
        return holder

    def expire_worker(self, worker_id: str) -> int:
        dropped = self._mutating("expire_worker", worker_id)
        self.live.expired(worker_id)
        return dropped

    def can_admit(self, items: Sequence[AdmitItem], lookahead: int) -> bool:
        return self._call("can_admit", {i.namespace: len(i.prompt_token_ids) + lookahead for i in items})

    def admit(self, items: Sequence[AdmitItem]) -> list[Admission]:
        items = list(items)
        return self._all_or_nothing("add_requests", items, lambda outcomes: self.live.admitted(items, outcomes))

    def fork(self, items: Sequence[tuple[str, str, str]]) -> list[Admission]:
        items = list(items)
        return self._all_or_nothing("forks", items, lambda outcomes: self.live.forked(items, outcomes))

    def _all_or_nothing(self, method: str, items: list[Any], record: Callable[[list[Any]], None]) -> list[Admission]:
        """One actor call making an entry per item; a refusal releases the entries the same call made."""
        outcomes = self._mutating(method, items)
        record(outcomes)
        refusals = [o for o in outcomes if isinstance(o, KVError)]
        if refusals:
            done = [(o.namespace, o.request_id) for o in outcomes if not isinstance(o, KVError)]
            if done:
                self._mutating("release", done)
                self.live.released(done)
            raise refusals[0]
        return outcomes

    def reserve(self, items: Sequence[ReserveItem]) -> list[Reservation | KVError]:
        items = list(items)
        outcomes = self._reporting("reserve_with_free", items, False)
        self.live.reserved(items, outcomes)
        return outcomes

    def commit(self, items: Sequence[CommitItem]) -> list[CommitResult | KVError]:
        items = list(items)
        outcomes = self._reporting("commit_with_free", items)
        self.live.committed(items, outcomes)
        return outcomes

    def commit_then_reserve(self, commits: Sequence[CommitItem], reserves: Sequence[ReserveItem]
                            ) -> tuple[list[CommitResult | KVError], list[Reservation | KVError]]:
        commits, reserves = list(commits), list(reserves)
        return self._recorded(commits, reserves,
                              self._reporting("commit_then_reserve_with_free", commits, reserves))

    def _recorded(self, commits: list[CommitItem], reserves: list[ReserveItem], answer: Any
                  ) -> tuple[list[CommitResult | KVError], list[Reservation | KVError]]:
        committed, reserved = answer
        self.live.committed(commits, committed)
        self.live.reserved(reserves, reserved)
        return committed, reserved

    def commit_then_reserve_ahead(self, commits: Sequence[CommitItem], reserves: Sequence[ReserveItem]) -> Any:
        """`commit_then_reserve`, sent now on its own connection and answered by `result()` (the caller's thread
        makes no other ledger call in between: the engine waits for its verify). On the Ray path: an actor call on
        a thread of its own. A call that reaches no ledger is sent again after the rebuild, when its answer is
        asked for."""
        commits, reserves = list(commits), list(reserves)
        if self._ahead is not None:
            context = contextvars.copy_context()  # the caller's trace context goes along
            return self._ahead.submit(context.run, self.commit_then_reserve, commits, reserves)
        assert self.ahead_link is not None
        method = "commit_then_reserve_with_free"
        try:
            pending: PendingCall | None = self.ahead_link.send(method, self.incarnation, commits, reserves,
                                                               timeout_s=self.timeout_s, **_trace_kwargs())
        except ChannelLost:
            pending = None  # sent again when its answer is asked for
        return _Reported(self, commits, reserves, pending)

    def rollback(self, keys: Sequence[tuple[str, str]]) -> None:
        keys = list(keys)
        outcomes = self._mutating("rollback", keys)
        self.live.rolled_back(keys, outcomes)
        self._raise_unexpected(outcomes)

    def release(self, request_id: str, namespaces: Sequence[str]) -> None:
        keys = [(namespace, request_id) for namespace in namespaces]
        outcomes = self._mutating("release", keys)
        self.live.released(key for key, outcome in zip(keys, outcomes, strict=True)
                           if not isinstance(outcome, KVError) or isinstance(outcome, UnknownRequest))
        self._raise_unexpected(outcomes)

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
        """True once this client can have no ledger any more: its actor died for good, or a restarted one could
        not be rebuilt. A restarted actor is rebuilt here (the scheduler's health check asks between rounds, so an
        idle engine's ledger comes back too); False while it answers, or is being restarted."""
        try:
            current = ray.get(self.actor.incarnation.remote(), timeout=self.timeout_s)
        except RayActorError:
            return actor_dead_for_good(self.actor)
        except GetTimeoutError:
            return False
        if current == self.incarnation:
            return False
        try:
            self.recover("restarted between rounds")
        except RetriableKVError:
            log.exception("the kv manager's ledger could not be rebuilt")
            return True
        return False

    @staticmethod
    def _raise_unexpected(outcomes: list[Any]) -> None:
        for outcome in outcomes:  # an unknown request is already gone: nothing to give back
            if isinstance(outcome, KVError) and not isinstance(outcome, UnknownRequest):
                raise outcome


def actor_dead_for_good(actor: Any) -> bool:
    """Whether Ray's control store has the actor DEAD (killed without restart, or out of restarts), not restarting.
    (Ray's public state API needs the dashboard, which these clusters run without.)"""
    try:
        info = ray._private.state.actors(actor_id=actor._actor_id.hex())
    except Exception:  # noqa: BLE001 - the control store unreachable: not known to be dead
        return False
    return bool(info) and info.get("State") == "DEAD"


def _trace_kwargs() -> dict[str, Any]:
    carrier = CURRENT_CARRIER.get()  # a traced step's: the actor continues its trace
    return {"trace_context": carrier} if carrier else {}


class _Reported:
    """An ahead ledger call's answer, read as `RemoteKV._reporting` reads one and recorded; a call that reached no
    ledger (`pending` None: it could not be sent) is sent again after the rebuild (`RemoteKV._call`)."""

    def __init__(self, kv: RemoteKV, commits: list[CommitItem], reserves: list[ReserveItem],
                 pending: PendingCall | None) -> None:
        self.kv = kv
        self.commits = commits
        self.reserves = reserves
        self.pending = pending

    def _answer(self) -> Any:
        method = "commit_then_reserve_with_free"
        if self.pending is not None:
            try:
                return self.pending.result()
            except (ChannelLost, LedgerRestarted) as lost:
                self.kv.recover(f"{method} (ahead): {lost!r}")
        return self.kv._call(method, self.commits, self.reserves)

    def result(self) -> Any:
        return self.kv._recorded(self.commits, self.reserves, self.kv._reported(self._answer))


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
            transport=transport, recovery_timeout_s=config.kv_recovery_timeout_s),
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
