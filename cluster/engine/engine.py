"""SpecEngine: the continuous-batching speculative-decoding loop (plain Python; no Ray).

One round for the running batch (ARCHITECTURE.md section 1):

    plan     k per request (fixed or auto; 0 = plain decode)        cluster/engine/spec_policy.py
    reserve  ONE ledger call: target slots (catch-up + k), draft slots (catch-up + k - 1)
    propose  ONE drafter call for the model-drafted requests; n-gram lookup in process
    verify   ONE verifier call: one forward scores every request's catch-up + drafts, then each
             request's contract decides accepted drafts + one correction/bonus token
    commit   ONE ledger call: the accepted prefix of every reservation; the rest goes back
    emit     tokens appended one by one with stop checks, exactly where plain decoding stops

Held commit (without overlap): a steady round's commit rides with the next round's reserve;
see cluster/engine/held_commit.py.

Ownership: the engine (the thread that calls `step`) owns every RequestState. `submit` and
`abort` may be called from other threads: they only enqueue, and `step` applies them first.
The workers own the KV tensors, the ledger owns block ids; tokens here are the truth.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.engine.commit import RoundCommit
from cluster.engine.held_commit import HeldCommitKV
from cluster.engine.overlap import OverlapRounds
from cluster.engine.recovery import WorkerRecovery
from cluster.engine.request_state import RequestState, TextTracker
from cluster.engine.round_plan import RoundPlan, propose_item, verify_item
from cluster.engine.spec_policy import CostModel, SeededInputs, choose_k, choose_k_seeded
from cluster.engine.stats import busy_fractions
from drafter_service.ngram import propose_ngram
from kv_manager.errors import KVError, OutOfBlocks
from kv_manager.schema import AdmitItem, Holder, ReserveItem
from specserve_types.api import CapacityError, GenerationRequest, InvalidRequestError, TokenChunk
from specserve_types.round_messages import (
    ProposeBatch,
    ProposeResult,
    VerifyBatch,
    VerifyResult,
)
from verifier_service.acceptance_stats import AcceptanceStats

log = logging.getLogger("specserve.engine")


class VerifierBackend(Protocol):
    holder: Holder

    def verify(self, batch: VerifyBatch) -> VerifyResult: ...


class DrafterBackend(Protocol):
    holder: Holder

    def propose(self, batch: ProposeBatch) -> ProposeResult: ...


class DrafterUnavailable(RuntimeError):
    """The draft model's worker is gone; requests continue by plain decoding."""


TARGET_NAMESPACE = "verifier/target"  # the ledger namespace of the target model's KV pool
DRAFT_NAMESPACE = "drafter/draft"  # the ledger namespace of the draft model's KV pool


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings, all required: their defaults and meanings live in ONE place,
    `ClusterConfig` (cluster/serving/config.py), whose `engine_config()` builds this."""

    max_batch: int  # requests per round
    max_waiting: int  # requests queued before the running batch (CapacityError past it)
    max_context: int  # prompt + max_tokens limit
    k_max: int  # largest k auto may pick (0: auto never speculates)
    probe_every: int  # rounds of plain decoding before auto re-measures acceptance
    pressure_free_fraction: float  # below this free fraction of the target pool, auto caps k at 1
    drafter_retry_seconds: float  # base back-off before a failed drafter is tried again
    max_verifier_failures: int  # consecutive failed verify calls tolerated; one more and the engine gives up
    overlap: bool  # draft one group while verifying the other (separate devices/processes pay off)

    def __post_init__(self) -> None:
        problems = [name for name, ok in (
            ("max_batch", self.max_batch >= 1), ("max_waiting", self.max_waiting >= 1),
            ("max_context", self.max_context >= 1), ("k_max", self.k_max >= 0),
            ("probe_every", self.probe_every >= 1),
            ("pressure_free_fraction", 0.0 <= self.pressure_free_fraction <= 1.0),
            ("drafter_retry_seconds", self.drafter_retry_seconds >= 0.0),
            ("max_verifier_failures", self.max_verifier_failures >= 0),
            ("overlap", isinstance(self.overlap, bool)),
        ) if not ok]
        if problems:
            raise ValueError(f"invalid EngineConfig field(s) {problems}: {self}")

    @property
    def target_namespace(self) -> str:
        return TARGET_NAMESPACE

    @property
    def draft_namespace(self) -> str:
        return DRAFT_NAMESPACE


class SpecEngine(RoundCommit, OverlapRounds, WorkerRecovery):
    def __init__(
        self, verifier: VerifierBackend, drafter: DrafterBackend | None, kv: Any, tokenizer: Any,
        eos_token_ids: tuple[int, ...], vocab_size: int, config: EngineConfig,
        model_name: str = "", draft_name: str = "none",
    ) -> None:
        self.verifier = verifier
        self.drafter = drafter
        # kv_manager ledger (in process) or a client of its actor, behind the held-commit wrapper
        self.kv = HeldCommitKV(kv, self._check_commits)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.config = config
        self.model_name = model_name
        self.draft_name = draft_name
        self.cost = CostModel()
        self.acceptance = AcceptanceStats()
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self._inbox: collections.deque[RequestState] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self._known_ids: set[str] = set()
        self._drafter_down_since: float | None = None
        self._rounds_at_zero: dict[str, int] = {}
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.fallback_events: list[dict[str, Any]] = []
        self.verifier_holder = kv.register_worker("verifier")
        self.drafter_holder = kv.register_worker("drafter") if drafter is not None else None
        self._turn = 0
        self._verifier_instance: str | None = None
        self._drafter_instance: str | None = None
        self._verifier_failures = 0
        self._drafter_failures = 0  # consecutive; retries back off exponentially
        self._in_flight: dict[int, Future] = {}
        self._in_flight_ids: set[str] = set()
        self._turns_without_plans = 0  # overlap: consecutive turns in which no plan got a reservation
        self._draft_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-draft")
        self._namespaces = [self.config.target_namespace] + ([self.config.draft_namespace] if drafter else [])

    # ------------------------------------------------------------------ requests in and out
    def submit(self, request: GenerationRequest) -> None:
        """Validate and enqueue; raises InvalidRequestError / CapacityError at once, changing nothing."""
        prompt_len = len(request.prompt_token_ids)
        if prompt_len + request.sampling.max_tokens > self.config.max_context:
            raise InvalidRequestError(
                "prompt", f"prompt ({prompt_len} tokens) + max_tokens ({request.sampling.max_tokens}) exceeds the "
                          f"context of {self.config.max_context} tokens")
        if any(not (0 <= t < self.vocab_size) for t in request.prompt_token_ids):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {self.vocab_size})")
        if request.spec.draft == "model" and self.drafter is None and request.spec.k != 0:
            raise InvalidRequestError("draft", "this engine has no draft model; use draft 'ngram' or 'none'")
        seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(63)
        state = RequestState(
            request=request, seed=seed, eos_token_ids=self.eos_token_ids,
            text=TextTracker(self.tokenizer, prompt_len, request.sampling.stop),
            token_ids=list(request.prompt_token_ids), prompt_len=prompt_len,
        )
        with self._lock:
            if request.request_id in self._known_ids:
                raise InvalidRequestError("request_id", f"duplicate request id {request.request_id!r}")
            if len(self.waiting) + len(self._inbox) >= self.config.max_waiting:
                raise CapacityError(f"queue full ({self.config.max_waiting} waiting requests)")
            self._known_ids.add(request.request_id)
            self._inbox.append(state)

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self._inbox or self._aborts)

    # ------------------------------------------------------------------ the round
    def step(self) -> list[TokenChunk]:
        """One round. With `overlap`, one round of one of two groups while the other group drafts."""
        chunks: list[TokenChunk] = []
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        deferred = []
        while self._aborts:
            rid = self._aborts.popleft()
            if rid in self._in_flight_ids:
                deferred.append(rid)  # its blocks are being written by the drafter: abort after that
            else:
                chunks.extend(self._abort_now(rid))
        self._aborts.extend(deferred)
        self._admit()
        if not self.running:
            return chunks
        round_start = time.perf_counter()
        if self.config.overlap:
            plans, draft_seconds = self._overlapped_prepare()
        else:
            plans = self._reserve([self._plan(state) for state in self.running], may_preempt=True)
            draft_seconds = self._propose(plans)
        if not plans:
            return chunks
        verify_result = self._verify(plans)
        if verify_result is None:  # the verifier failed or was replaced: requests re-prefill
            return chunks
        reconcile_start = time.perf_counter()
        chunks.extend(self._accept_and_commit(plans, verify_result.outputs))
        reconcile_seconds = time.perf_counter() - reconcile_start
        for plan in plans:
            plan.state.draft_seconds += draft_seconds
            plan.state.verify_seconds += verify_result.seconds
            plan.state.reconcile_seconds += reconcile_seconds
        self.totals["rounds"] += 1
        self.totals["draft_seconds"] += draft_seconds
        self.totals["verify_seconds"] += verify_result.seconds
        self.totals["reconcile_seconds"] += reconcile_seconds
        self.totals["round_seconds"] += time.perf_counter() - round_start
        return chunks

    def _admit(self) -> None:
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_batch:
            state = self.waiting[0]
            items = [AdmitItem(cfg.target_namespace, state.request_id, state.token_ids, self.verifier_holder)]
            if not self.kv.can_admit(items, lookahead=cfg.k_max + 1):
                break  # memory pressure: wait for running requests to finish
            (admission,) = self.kv.admit(items)
            self.waiting.popleft()
            state.target_cached = admission.num_cached_tokens
            state.admitted = True
            sizes = [sum(1 for r in self.running if r.group == g) for g in (0, 1)]
            state.group = 0 if sizes[0] <= sizes[1] else 1
            self.running.append(state)
            log.debug("admitted %s (%d prompt tokens, %d cached)", state.request_id, state.prompt_len,
                      state.target_cached)

    def _admit_draft(self, state: RequestState) -> bool:
        """Enter the request in the draft namespace (first speculative round, or after a drafter restart)."""
        if state.draft_admitted:
            return True
        try:
            (admission,) = self.kv.admit([AdmitItem(self.config.draft_namespace, state.request_id, state.token_ids,
                                                    self.drafter_holder)])
        except KVError as exc:
            log.warning("draft admission refused for %s: %s", state.request_id, exc)
            return False
        state.draft_cached = admission.num_cached_tokens
        state.draft_admitted = True
        return True

    def _plan(self, state: RequestState) -> RoundPlan:
        spec = state.request.spec
        remaining = state.request.sampling.max_tokens - state.num_output
        k_cap = max(0, min(self.config.k_max if spec.k is None else spec.k, remaining - 1))
        plan = RoundPlan(state=state, k=0, target_pending=state.token_ids[state.target_cached:])
        if spec.draft == "none" or k_cap == 0:
            state.record_k(0, "no speculation requested" if spec.draft == "none" or spec.k == 0 else "end of output")
            return plan
        if spec.draft == "model" and not self._drafter_usable():
            state.record_k(0, "fallback: drafter unavailable, plain decoding")
            return plan
        if spec.k is not None:
            k, reason = k_cap, "fixed k"
        elif state.request.sampling.seed is not None and not state.request.sampling.is_greedy:
            # its own history only, so the seed reproduces its tokens whatever the batch and timing
            decision = choose_k_seeded(SeededInputs.of(
                state.acceptance, k_cap, self._rounds_at_zero.get(state.request_id, 0), self.config.probe_every,
                model_draft=spec.draft == "model"))
            k, reason = decision.k, decision.reason
        else:
            decision = choose_k(
                state.acceptance, self.acceptance, self.cost, k_cap, len(plan.target_pending),
                self._rounds_at_zero.get(state.request_id, 0), self.config.probe_every,
                self.kv.free_fraction(self.config.target_namespace), self.config.pressure_free_fraction,
                draft_cost_per_token=0.0 if spec.draft == "ngram" else self.cost.draft_token,
                batch=self._batch_size(state))
            k, reason = decision.k, decision.reason
        if k == 0:
            self._rounds_at_zero[state.request_id] = self._rounds_at_zero.get(state.request_id, 0) + 1
        else:
            self._rounds_at_zero[state.request_id] = 0
        if spec.draft == "ngram" and k > 0:
            plan.drafts = propose_ngram(state.token_ids, k)
            k = len(plan.drafts)
            if k == 0:
                reason = "n-gram: no match"
        elif spec.draft == "model" and k > 0:
            if not self._admit_draft(state):
                state.record_k(0, "draft cache out of blocks")
                return plan
            plan.uses_model_drafter = True
            plan.draft_pending = state.token_ids[state.draft_cached:]
        plan.k = k
        state.record_k(k, reason)
        return plan

    def _batch_size(self, state: RequestState) -> int:
        """Requests verified together with `state` (its group under overlap)."""
        if self.config.overlap:
            return sum(1 for s in self.running if s.group == state.group)
        return len(self.running)

    def _reserve(self, plans: list[RoundPlan], may_preempt: bool) -> list[RoundPlan]:
        cfg = self.config
        items = [ReserveItem(cfg.target_namespace, p.state.request_id, len(p.target_pending) + p.k, self.verifier_holder)
                 for p in plans]
        items += [ReserveItem(cfg.draft_namespace, p.state.request_id, len(p.draft_pending) + p.k - 1,
                              self.drafter_holder) for p in plans if p.uses_model_drafter]
        kv_start = time.perf_counter()
        results = self.kv.reserve(items)  # carries the last round's held commit, if any
        self.totals["kv_seconds"] += time.perf_counter() - kv_start
        grants = {(r.namespace, r.request_id): r for r in results if not isinstance(r, KVError)}
        kept: list[RoundPlan] = []
        for plan in plans:
            rid = plan.state.request_id
            target = grants.get((cfg.target_namespace, rid))
            if target is None:
                if plan.uses_model_drafter and (cfg.draft_namespace, rid) in grants:
                    self.kv.rollback([(cfg.draft_namespace, rid)])
                continue  # out of blocks this round: skipped; preempted below if nothing runs
            plan.target_grant = target
            if plan.uses_model_drafter:
                draft = grants.get((cfg.draft_namespace, rid))
                if draft is None:
                    plan.uses_model_drafter = False
                    plan.k = 0
                    plan.state.record_k(0, "draft cache out of blocks")
                else:
                    plan.draft_grant = draft
            kept.append(plan)
        if not kept and plans and may_preempt:
            self._preempt(self.running[-1])
        return kept

    def _preempt(self, state: RequestState) -> None:
        """Give all of a request's KV back and requeue it; it re-prefills from its tokens (nothing is lost)."""
        log.warning("preempting %s: out of KV blocks", state.request_id)
        self.kv.release(state.request_id, self._namespaces)
        self.running.remove(state)
        state.target_cached = state.draft_cached = 0
        state.admitted = state.draft_admitted = False
        self.waiting.appendleft(state)
        self.fallback_events.append({"at": time.time(), "request_id": state.request_id, "event": "preempted"})

    def _propose(self, plans: list[RoundPlan]) -> float:
        model_plans = [p for p in plans if p.uses_model_drafter and p.k > 0]
        if not model_plans:
            return 0.0
        items = [propose_item(p) for p in model_plans]
        start = time.perf_counter()
        try:
            result = self.drafter.propose(ProposeBatch(items))
        except Exception as exc:  # the drafter died: continue by plain decoding
            self._on_drafter_failure(model_plans, exc)
            return time.perf_counter() - start
        self._drafter_failures = 0
        replaced = self._drafter_instance is not None and result.worker_instance != self._drafter_instance
        self._drafter_instance = result.worker_instance
        if replaced:  # its drafts came from an empty KV pool: worthless, so this round decodes plainly
            self._on_drafter_replaced()
            for p in model_plans:
                p.uses_model_drafter, p.k, p.drafts, p.draft_probs = False, 0, [], None
                p.state.record_k(0, "drafter replaced: re-prefilling its cache")
            return time.perf_counter() - start
        if all(len(p.draft_pending) <= 2 for p in model_plans):  # a catch-up prefill is not a draft step
            self.cost.observe_draft(max(p.k for p in model_plans), result.seconds)
        by_id = {o.request_id: o for o in result.outputs}
        for p in model_plans:
            out = by_id[p.state.request_id]
            p.drafts, p.draft_probs = out.draft_ids, out.draft_probs
        return time.perf_counter() - start

    def _verify(self, plans: list[RoundPlan]) -> VerifyResult | None:
        items = [verify_item(p) for p in plans]
        call_start = time.perf_counter()
        try:
            result = self.verifier.verify(VerifyBatch(items))
        except Exception as exc:
            self._verifier_failures += 1
            if self._verifier_failures > self.config.max_verifier_failures:
                raise
            self._recover_verifier(plans, f"verifier failed: {exc!r}")
            time.sleep(min(2.0, 0.05 * 2 ** self._verifier_failures))
            return None
        if self._verifier_instance is not None and result.worker_instance != self._verifier_instance:
            self._verifier_instance = result.worker_instance
            self._recover_verifier(plans, "verifier replaced (new process, empty KV pool)")
            return None
        self._verifier_instance = result.worker_instance
        self._verifier_failures = 0
        self.totals["verify_call_seconds"] += time.perf_counter() - call_start  # result.seconds + the hop
        self.cost.observe_verify(sum(len(i.input_ids) + len(i.draft_ids) for i in items), result.seconds)
        return result

    def _abort_now(self, request_id: str) -> list[TokenChunk]:
        for state in list(self.running):
            if state.request_id == request_id:
                self.running.remove(state)
                self.kv.release(request_id, self._namespaces)
                return [self._aborted_chunk(state)]
        for state in list(self.waiting):
            if state.request_id == request_id:  # a waiting request holds nothing in the ledger: nothing to release
                assert not (state.admitted or state.draft_admitted), f"waiting {request_id} holds KV"
                self.waiting.remove(state)
                return [self._aborted_chunk(state)]
        return []

    def _aborted_chunk(self, state: RequestState) -> TokenChunk:
        state.finish_reason = "abort"
        self._forget(state.request_id)
        return TokenChunk(state.request_id, [], "", finish_reason="abort", stats=state.stats())

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._known_ids.discard(request_id)
        self._rounds_at_zero.pop(request_id, None)

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, Any]:
        rounds = self.totals.get("rounds", 0)
        return {
            "model": self.model_name,
            "draft": self.draft_name,
            "running": len(self.running),
            "waiting": len(self.waiting) + len(self._inbox),
            "rounds": int(rounds),
            "acceptance": self.acceptance.to_dict(),
            "draft_seconds": self.totals.get("draft_seconds", 0.0),
            "verify_seconds": self.totals.get("verify_seconds", 0.0),
            "reconcile_seconds": self.totals.get("reconcile_seconds", 0.0),
            "round_seconds": self.totals.get("round_seconds", 0.0),
            "verify_call_seconds": self.totals.get("verify_call_seconds", 0.0),  # verify + the hop to it
            "kv_seconds": self.totals.get("kv_seconds", 0.0),  # the round's reserve and commit calls
            "cost_model": {"draft_token_seconds": self.cost.draft_token,
                           "verify_seconds_by_tokens": dict(self.cost.verify_by_tokens)},
            **busy_fractions(self.totals),
            "fallback_events": list(self.fallback_events),
            "kv_free_fraction": self.kv.free_fraction(self.config.target_namespace),
        }

    def reset_statistics(self) -> None:
        """Forget acceptance, time totals and events (after warm-up); the cost model stays."""
        self.acceptance = AcceptanceStats()
        self.totals = collections.defaultdict(float)
        self.fallback_events.clear()

    def close(self) -> None:
        """Stop the draft thread (after its in-flight work); send a held commit."""
        self._draft_pool.shutdown(wait=True)
        self.kv.send_held()

    def run_to_completion(self) -> dict[str, list[TokenChunk]]:
        """Drive `step` until every submitted request has finished (in-process use)."""
        out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
        while self.has_unfinished():
            for chunk in self.step():
                out[chunk.request_id].append(chunk)
        return out


__all__ = ["SpecEngine", "EngineConfig", "DrafterUnavailable", "OutOfBlocks"]
