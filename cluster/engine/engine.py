"""SpecEngine: the continuous-batching speculative-decoding loop (plain Python; no Ray).

One round for the running batch (docs/ARCHITECTURE.md §2), as `step` reads; each phase returns new values
(round_plan.py: a plan is frozen, its transitions live there), and the engine applies what its functions decide:

    plan     k per request (fixed or auto; 0 = plain decode); n-gram, suffix drafts (trees)   planner.py
    reserve  ONE ledger call: target slots (catch-up + k), draft slots (catch-up + k - 1)
    propose  ONE drafter call for the model-drafted requests (n-gram drafts were made by the plan)  drafting.py
    verify   ONE verifier call: one forward scores every request's catch-up + drafts, then each   verify_call.py
             request's contract decides accepted drafts + one correction/bonus token
    accept   the outcome applied: tokens appended one by one with stop checks, exactly where plain
             decoding stops; the commits, chunks and finished requests as values  accept.py
    commit   ONE ledger call: the kept prefix of every reservation; the rest goes back
    emit     the chunks; finished requests leave

How a step strings the phases together is its mode, chosen at construction (step_modes.py: one function each):
serial (a steady round's commit rides with the next reserve, held_commit.py), two groups in ping-pong
(overlap.py), or pre-drafting (predraft.py). The phases here ask no mode question: the step passes what differs.
What the collaborators decide comes back as values applied here: a plan's k and reason (`record_k`), the drafter's
answer (`Drafted`), the verify's totals, give_back.py's `GiveBack`, the pre-drafter's kept plans.

Ownership (docs/ARCHITECTURE.md §3): the thread that calls `step` (the engine thread) owns every
RequestState, RoundPlan and the ledger client. `submit` and `abort` may be called from other threads:
they only enqueue in the `RequestInbox` (inbox.py), and `step` applies them first. The workers own the KV tensors, the
ledger owns block ids; tokens here are the truth.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from cluster.engine.accept import RoundOutcome, accept_round, record_acceptance
from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.backends import DrafterBackend, VerifierBackend
from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE, EngineConfig
from cluster.engine.drafting import Drafted, enter_draft, propose, propose_batch
from cluster.engine.fair_share import YIELD, admissions
from cluster.engine.give_back import (
    OUT_OF_BLOCKS,
    GiveBack,
    Parts,
    abort_now,
    check_commits,
    preempt,
    recover_verifier,
    restart_draft_caches,
)
from cluster.engine.held_commit import HeldCommitKV
from cluster.engine.inbox import RequestInbox
from cluster.engine.kv_client import KVClient
from cluster.engine.overlap import DraftPipeline
from cluster.engine.overlap_policy import engine_overlap
from cluster.engine.planner import plan_context, plan_request
from cluster.engine.predraft import PreDrafter
from cluster.engine.request_state import RequestState, new_request_state
from cluster.engine.round_plan import (
    RoundPlan,
    granted,
    reserve_items,
    window_items,
)
from cluster.engine.shared_prompts import SharedPrompts, group_states
from cluster.engine.spec_policy import CostModel, nominal_costs
from cluster.engine.stats import add_round_times, engine_stats
from cluster.engine.step_modes import PREDRAFTING, SERIAL, STEPS, step_mode
from cluster.engine.step_record import EngineObserver
from cluster.engine.step_trace import StepTrace
from cluster.engine.verify_call import VerifierLost, VerifyCall, verify_round
from cluster.engine.worker_health import WorkerHealth
from drafter_service.suffix_drafts import SuffixDrafter
from kv_manager.errors import KVError
from kv_manager.schema import ReserveItem
from specserve_types.api import GenerationRequest, InvalidRequestError, TokenChunk
from specserve_types.round_messages import ProposeBatch, VerifyResult
from verifier_service.constraint import ConstraintCompiler

log = logging.getLogger("specserve.engine")


def record_k(plans: Sequence[RoundPlan]) -> None:
    """Each plan's k and why, and the request's plain-decoding rounds, recorded on its request: the planner's
    choice as planned, a fallback to plain decoding as verified (a repeated k is recorded once)."""
    for plan in plans:
        if plan.reason:
            plan.state.record_k(plan.k, plan.reason, plan.rounds_at_zero)


class SpecEngine:
    def __init__(
        self, verifier: VerifierBackend, drafter: DrafterBackend | None, kv: KVClient, tokenizer: Any,
        eos_token_ids: tuple[int, ...], vocab_size: int, config: EngineConfig,
        model_name: str = "", draft_name: str = "none", *, dtypes: Mapping[str, str] | None = None,
        observer: EngineObserver | None = None, cost: CostModel | None = None,
        acceptance: AcceptanceStats | None = None, lookup_acceptance: AcceptanceStats | None = None,
        constraints: ConstraintCompiler | None = None,
    ) -> None:
        """Complete at construction: `dtypes` ({"target": "bfloat16", "draft": ...}, as the workers resolved them),
        the `observer` (traces, metrics), and a carried-over policy state (`cost`, `acceptance` of the drafter's drafts,
        `lookup_acceptance` of model-drafted requests' n-gram lookups) and the constraint compiler of an engine it
        replaces (`constraints`: its tokenizer and compiled grammars) come in here; nothing outside sets an attribute
        later."""
        self.verifier = verifier
        self.drafter = drafter
        # the ledger (in process or its actor's client)
        self.kv = HeldCommitKV(kv, lambda commits, results: check_commits(self.running, self.kv, commits, results))
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.config = config
        self.model_name = model_name
        self.draft_name = draft_name
        self.dtypes: dict[str, str] = dict(dtypes or {})
        self.nominal = nominal_costs(self.dtypes.get("target", "float32"), self.dtypes.get("draft"))  # seeded k's
        self.cost = cost if cost is not None else CostModel()
        self.acceptance = acceptance if acceptance is not None else AcceptanceStats()
        self.lookup_acceptance = lookup_acceptance if lookup_acceptance is not None else AcceptanceStats()
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.fallback_events: list[dict[str, Any]] = []  # appended here: the health's come at each step's end
        self.health = WorkerHealth(self.kv, drafter is not None, config.drafter_retry_seconds,
                                   config.max_verifier_failures)
        self.mode = step_mode(config, drafter is not None)  # serial, ping-pong or pre-drafting (step_modes.py)
        # the draft thread's flights (ping-pong, pre-drafting) and the kept pre-drafts
        self.pipeline = DraftPipeline(drafter.propose) if drafter is not None and self.mode != SERIAL else None
        self.predrafter = PreDrafter(self.pipeline, self.health, vocab_size) if self.pipeline is not None \
            and self.mode == PREDRAFTING else None
        self.overlap = engine_overlap(config.overlap, config.overlap_reason, config.predraft, drafter is not None)
        log.info("overlap %s (%s)%s", self.overlap["mode"] or "off", self.overlap["reason"],
                 f"; pre-drafting {self.overlap['predraft']}" if "predraft" in self.overlap else "")
        self.namespaces = [TARGET_NAMESPACE] + ([DRAFT_NAMESPACE] if drafter else [])
        self.inbox = RequestInbox(config.max_waiting)  # shared with submit/abort callers; step drains it
        self.shared = SharedPrompts(self.kv, self.inbox)  # prompt groups: n completions prefill once
        # constraints (verifier_service/constraint.py): llguidance's tokenizer, built beside the engine's start, and
        # the compiled grammars
        self.constraints = constraints if constraints is not None else ConstraintCompiler(
            tokenizer, vocab_size, eos_token_ids, prebuild=True) if tokenizer is not None else None
        self.suffix = SuffixDrafter()  # suffix drafts' tries (drafter_service/suffix_drafts.py); the planner's
        self.trace = StepTrace(observer)  # traces, metrics: the observer gets a StepRecord per step
        self.parts = Parts(self.kv, self.shared, self.health, self.trace, self.inbox, tuple(self.namespaces))

    # ------------------------------------------------------------------ requests in and out (any thread)
    def submit(self, request: GenerationRequest) -> None:
        """Validate and enqueue; raises InvalidRequestError / CapacityError at once, changing nothing."""
        self.inbox.put(self._new_state(request), waiting=len(self.waiting))

    def submit_group(self, requests: list[GenerationRequest]) -> None:
        """The n completions of one prompt, all or none (raises like `submit`, changing nothing): the prompt is
        prefilled once and the others fork its KV (shared_prompts.py); each draws from its own seed."""
        states = [self._new_state(r) for r in requests]
        if any(r.prompt_token_ids != requests[0].prompt_token_ids for r in requests):
            raise InvalidRequestError("prompt", "the completions of one group share one prompt")
        group = group_states(states)
        self.inbox.put_group(states, waiting=len(self.waiting), reserved=(group.key,) if group else ())

    def _new_state(self, request: GenerationRequest) -> RequestState:
        return new_request_state(request, self.tokenizer, self.eos_token_ids, self.vocab_size, self.config.max_context,
                                 has_drafter=self.drafter is not None, constraints=self.constraints)

    def abort(self, request_id: str) -> None:
        self.inbox.abort(request_id)

    def unobserved(self) -> AbstractContextManager[None]:
        """Steps inside are not handed to the observer (warm-up: its rounds are not the users')."""
        return self.trace.muted()

    @property
    def observer(self) -> EngineObserver | None:
        return self.trace.observer

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.inbox.pending())

    # ------------------------------------------------------------------ the round (engine thread)
    def step(self) -> list[TokenChunk]:
        """One round (with overlap: one group's round while the other group's drafts are made)."""
        self.trace.start()
        try:
            # new requests join the queue; aborts apply, except for requests whose drafts are in flight (the
            # drafter is writing their draft KV): those wait for their group to land
            states, aborts = self.inbox.drain(defer=self.in_flight_ids())
            self.waiting.extend(states)
            chunks = [chunk for rid in aborts for chunk in self.give_back(abort_now(self.parts, self.running,
                                                                                     self.waiting, rid))]
            self._admit()
            if self.running:
                chunks.extend(STEPS[self.mode](self))  # the round, as the mode strings its phases
            return chunks
        finally:
            if events := self.health.take_events():  # in time order with the step's own (preempted)
                self.fallback_events[:] = sorted(self.fallback_events + events, key=lambda e: e["at"])
            self.trace.finish(self.fallback_events, self.health.drafter_holder, self.health.verifier_holder)

    def in_flight_ids(self) -> set[str]:
        """Requests whose drafts the draft thread is making (an abort of one waits for its group to land)."""
        return self.pipeline.in_flight_ids() if self.pipeline is not None else set()

    def give_back(self, back: GiveBack) -> tuple[TokenChunk, ...]:
        """A collaborator's decision on the engine's lists (give_back.py), applied; its chunks."""
        for state in back.leave:
            self.running.remove(state)
        for state in back.unqueue:
            self.waiting.remove(state)
        self.waiting.extendleft(reversed(back.requeue))
        if back.event is not None:
            self.fallback_events.append(back.event)
        return back.chunks

    def preempt(self, state: RequestState, reason: str = OUT_OF_BLOCKS) -> None:
        self.give_back(preempt(self.parts, state, reason))

    def restart_draft_caches(self) -> None:
        """The drafter's epoch changed: no kept pre-draft is usable, every request re-enters the draft namespace."""
        if self.predrafter is not None:
            self.predrafter.forget()
        restart_draft_caches(self.running, self.shared)

    def _admit(self) -> None:
        """Waiting requests join the batch, tenants in turn (fair_share.py): the one with the fewest requests
        running goes first, and a full batch yields a slot to a tenant short of its share."""
        for decision, state in admissions(self.waiting, self.running, self.config.max_batch, self.config.k_max + 1,
                                          self.kv, self.shared, self.health, self.in_flight_ids):
            if decision == YIELD:
                self.preempt(state, "fair share: a slot for another tenant")
                continue
            self.waiting.remove(state)
            self.running.append(state)
            log.debug("admitted %s (%d prompt tokens, %d cached)", state.request_id, state.prompt_len,
                      state.target_cached)

    # ------------------------------------------------------------------ the phases (step_modes.py strings them)
    def propose(self, plans: list[RoundPlan], own_step: bool) -> tuple[list[RoundPlan], float]:
        """The drafter call for the reserved plans, waited for on this thread; the plans with their drafts."""
        batch = self.propose_batch(plans, own_step)
        if batch is None:
            return plans, 0.0
        drafted = propose(self.drafter, batch, plans, self.trace, self.health, self.cost,  # type: ignore[arg-type]
                          self.vocab_size)
        return self.drafted(drafted), drafted.seconds

    def plan(self, states: list[RequestState], model_trees: bool, kept: Mapping[str, RoundPlan] | None = None,
             void: Sequence[tuple[str, str]] = ()) -> list[RoundPlan]:
        """A plan per state (`kept`: the pre-drafter's, by request id; `void`: its stale reservations, rolled back);
        model-drafted ones enter the draft namespace (or decode plainly if it is full). `model_trees`: a draft
        model may draft token trees (serial steps only: the others draft ahead in chains)."""
        context = plan_context(self.config, states, lambda: self.kv.free_fraction(TARGET_NAMESPACE),
                               self.health.drafter_usable, self.acceptance, self.cost, self.nominal, self.suffix,
                               model_trees)
        self.suffix.retain(s.request_id for s in self.running)  # tries of requests that left (aborted, requeued)
        plans = [kept[s.request_id] if kept and s.request_id in kept else
                 self.shared.prefill_plan(s, context.drafter_usable) or plan_request(s, context) for s in states]
        record_k(plans)
        if void:
            self.kv.rollback(void)
        return [enter_draft(self.kv, plan, self.health.drafter_holder) for plan in plans]

    def reserve(self, plans: list[RoundPlan], may_preempt: bool, own_step: bool) -> list[RoundPlan]:
        """Each plan's maximum, in one call; a plan refused its target slots sits this round out. `own_step`: the
        plans are this step's (ping-pong: the other group's next step)."""
        items = reserve_items(plans, self.health.verifier_holder, self.health.drafter_holder)
        if own_step:
            self.trace.begin(plans)
        kv_start = time.perf_counter()
        with self.trace.phase("kv.reserve", items=len(items)) as attributes:
            results = self.kv.reserve(items)  # carries the last round's held commit, if any
            attributes["refused"] = sum(isinstance(r, KVError) for r in results)
        self.totals["kv_seconds"] += time.perf_counter() - kv_start
        kept, refused = granted(plans, results)
        for request_id in refused:  # refused its target slots: its draft grant goes back
            self.kv.rollback([(DRAFT_NAMESPACE, request_id)])
        if not kept and plans and may_preempt:
            self.preempt(self.running[-1])
        return kept

    def propose_batch(self, plans: list[RoundPlan], own_step: bool) -> ProposeBatch | None:
        """The drafter call's batch (None: no plan needs it); under two groups it drafts the other group's next
        round and carries no trace of this step's (`own_step` False)."""
        if own_step:
            self.trace.begin(plans)
        return propose_batch(plans, self.config.constrain_drafts, self.trace.trace_context if own_step else ())

    def drafted(self, drafted: Drafted) -> list[RoundPlan]:
        """What drafting.py decided, applied (every draft cache restarts if the drafter's epoch changed; early
        stops counted); its plans."""
        if drafted.restart:
            self.restart_draft_caches()
        self._count(drafted.stops)
        return drafted.plans

    def verify(self, plans: list[RoundPlan], windows: bool) -> VerifyCall | None:
        """Constrained rows, then ONE verifier call (`windows`: reservation windows beside it, serial steps only:
        pre-drafting reserves its drafts' slots itself, two groups interleave their rounds). A lost verifier: every
        request is requeued and re-prefills from its tokens, and None."""
        record_k(plans)  # the fallbacks to plain decoding since the plan
        try:
            call = verify_round(self.verifier, self.kv, self.health, self.trace, self.cost, plans,
                                self.config.exact_rule, self._windows if windows else None)
        except VerifierLost as lost:
            self._count(lost.totals)
            flights = self.pipeline.drain() if self.pipeline is not None else []
            self.give_back(recover_verifier(self.parts, self.running, flights, str(lost)))
            self.shared.target_lost(self.waiting)
            return None
        self._count(call.totals)
        return call

    def _windows(self, plans: list[RoundPlan]) -> list[ReserveItem] | None:
        """The held commit's ledger call's reservation windows (held_commit.py), while the target pool is not short
        of blocks (None: no call beside the verify; in process it runs before the verify)."""
        if not self.config.reservation_windows or \
                self.kv.free_fraction(TARGET_NAMESPACE) <= self.config.pressure_free_fraction:
            return None
        return window_items(plans, self.config.k_max, self.health.verifier_holder, self.health.drafter_holder)

    def _count(self, totals: Mapping[str, float]) -> None:
        for key, value in totals.items():
            self.totals[key] += value

    def accept(self, plans: list[RoundPlan], result: VerifyResult) -> RoundOutcome:
        with self.trace.phase("accept"):
            return accept_round(plans, result.outputs, self.health.verifier_holder, self.health.drafter_holder)

    def close_round(self, plans: list[RoundPlan], outcome: RoundOutcome, hold: bool, draft_seconds: float,
                    verify_seconds: float, round_start: float, accept_start: float) -> list[TokenChunk]:
        """Commit (`hold`: a steady round's commit waits for the next ledger call), emit, count; the chunks."""
        self._commit(outcome, hold and not outcome.finished)
        self.shared.after_commit(plans)  # prefillers' prefixes become their groups' shared prompts
        with self.trace.phase("emit", chunks=len(outcome.chunks)):
            for state in outcome.finished:
                self.running.remove(state)
                self.inbox.forget(state.request_id)
                self.suffix.finish(state.request_id, state.output_ids if state.request.spec.draft == "suffix" else ())
        self.trace.rounds(plans, outcome)
        now = time.perf_counter()
        add_round_times(self.totals, plans, draft_seconds, verify_seconds, now - accept_start, now - round_start)
        return outcome.chunks

    def _commit(self, outcome: RoundOutcome, hold: bool) -> None:
        self._count(record_acceptance(outcome.acceptance, self.acceptance, self.lookup_acceptance))
        for request_id in outcome.release_draft:
            self.kv.release(request_id, [DRAFT_NAMESPACE])
        kv_start = time.perf_counter()
        with self.trace.phase("kv.commit", items=len(outcome.commits), held=hold):
            self.kv.commit(outcome.commits, hold=hold)
        self.totals["kv_seconds"] += time.perf_counter() - kv_start

    # ------------------------------------------------------------------ checks, statistics, shutdown
    def check_ledger(self) -> None:
        """Assert that the ledger holds entries only for running requests (in-flight ones included): none for a
        waiting or ended request, none at all once every request ended. One ledger call per namespace."""
        running = {state.request_id for state in self.running}
        in_flight = self.in_flight_ids()
        assert in_flight <= running, f"in flight but not running: {sorted(in_flight - running)}"
        running |= self.shared.keys()  # the shared prompts of groups with members still to fork
        for namespace in self.namespaces:
            held = set(self.kv.request_ids(namespace))
            assert held <= running, f"{namespace}: the ledger holds {sorted(held - running)}, which are not running"

    def stats(self) -> dict[str, Any]:
        identity = {"model": self.model_name, "draft": self.draft_name, "dtype": dict(self.dtypes),
                    "exact_rule": self.config.exact_rule, "running": len(self.running), "waiting": len(self.waiting) + self.inbox.queued()}
        overlap = self.overlap | ({"predraft": self.predrafter.summary()} if self.predrafter is not None else {})
        return engine_stats(identity, self.totals, self.acceptance, self.cost, self.fallback_events,
                            self.kv.free_fraction(TARGET_NAMESPACE), overlap, self.lookup_acceptance)

    def reset_statistics(self) -> None:
        """Forget acceptance, time totals and events (after warm-up); the cost model stays."""
        self.acceptance = AcceptanceStats()
        self.lookup_acceptance = AcceptanceStats()
        self.totals = collections.defaultdict(float)
        self.fallback_events.clear()
        self.trace.events_reset()

    def close(self) -> None:
        """Stop the draft thread (after its in-flight call); send a held commit."""
        if self.pipeline is not None:
            self.pipeline.close()
        self.kv.send_held()

    def run_to_completion(self) -> dict[str, list[TokenChunk]]:
        """Drive `step` until every submitted request has finished (in-process use)."""
        out: dict[str, list[TokenChunk]] = collections.defaultdict(list)
        while self.has_unfinished():
            for chunk in self.step():
                out[chunk.request_id].append(chunk)
        return out


__all__ = ["SpecEngine", "VerifierLost", "record_k"]
