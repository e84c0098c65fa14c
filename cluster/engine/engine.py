"""SpecEngine: the continuous-batching speculative-decoding loop (plain Python; no Ray).

One round for the running batch (docs/ARCHITECTURE.md §2), as `step` reads:

    plan     k per request (fixed or auto; 0 = plain decode)            planner.py, spec_policy.py
    reserve  ONE ledger call: target slots (catch-up + k), draft slots (catch-up + k - 1)
    propose  ONE drafter call for the model-drafted requests (n-gram drafts were made by the plan)
    verify   ONE verifier call: one forward scores every request's catch-up + drafts, then each
             request's contract decides accepted drafts + one correction/bonus token
    accept   tokens appended one by one with stop checks, exactly where plain decoding stops  accept.py
    commit   ONE ledger call: the kept prefix of every reservation; the rest goes back
    emit     the chunks; finished requests leave

Held commit (without overlap): a steady round's commit rides with the next round's reserve
(held_commit.py). Overlap (when overlap_policy.py says so): plan, reserve and verify stay here; only the
drafter call of the other group crosses the step (overlap.py), or with pre-drafting the drafter call of the
same requests' next round runs during their verify (predraft.py).

Ownership (docs/ARCHITECTURE.md §3): the thread that calls `step` (the engine thread) owns every
RequestState, RoundPlan and the ledger client. `submit` and `abort` may be called from other threads:
they only enqueue in the `RequestInbox` (inbox.py), and `step` applies them first. The workers own the KV tensors, the
ledger owns block ids; tokens here are the truth.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from cluster.engine.accept import RoundOutcome, accept_round
from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.backends import DrafterBackend, VerifierBackend
from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE, EngineConfig
from cluster.engine.held_commit import HeldCommitKV
from cluster.engine.inbox import RequestInbox
from cluster.engine.kv_client import KVClient
from cluster.engine.overlap import DraftPipeline, InFlight
from cluster.engine.overlap_policy import engine_overlap
from cluster.engine.planner import PlanContext, plan_request
from cluster.engine.predraft import PreDrafter, predraft_slots, void_draft_grants
from cluster.engine.request_state import RequestState, new_request_state
from cluster.engine.round_plan import RoundPlan, propose_item, verify_item
from cluster.engine.shared_prompts import SharedPrompts, group_states
from cluster.engine.spec_policy import CostModel, nominal_costs
from cluster.engine.stats import add_round_times, engine_stats
from cluster.engine.step_record import EngineObserver, Rollback, RoundRecord, StepRecord, new_step_record
from cluster.engine.worker_health import WorkerHealth
from kv_manager.errors import KVError
from kv_manager.schema import AdmitItem, CommitItem, ReserveItem
from specserve_types.api import GenerationRequest, InvalidRequestError, TokenChunk
from specserve_types.faults import FAULTS
from specserve_types.round_messages import ProposeBatch, ProposeResult, VerifyBatch, VerifyResult
from specserve_types.tracing import CURRENT_CARRIER

log = logging.getLogger("specserve.engine")


class InvalidDrafts(Exception):
    """The drafter answered with drafts the engine refuses (ids outside the vocabulary, a wrong count)."""


class VerifierLost(Exception):
    """This round's verify produced nothing usable: the call failed or a new verifier process answered."""


class SpecEngine:
    def __init__(
        self, verifier: VerifierBackend, drafter: DrafterBackend | None, kv: KVClient, tokenizer: Any,
        eos_token_ids: tuple[int, ...], vocab_size: int, config: EngineConfig,
        model_name: str = "", draft_name: str = "none", *, dtypes: Mapping[str, str] | None = None,
        observer: EngineObserver | None = None, cost: CostModel | None = None,
        acceptance: AcceptanceStats | None = None,
    ) -> None:
        """Complete at construction: `dtypes` ({"target": "bfloat16", "draft": ...}, as the workers resolved them),
        the `observer` (traces, metrics), and a carried-over policy state (`cost`, `acceptance`) come in here;
        nothing outside sets an attribute later."""
        self.verifier = verifier
        self.drafter = drafter
        self.kv = HeldCommitKV(kv, self._check_commits)  # the ledger (in process or its actor's client)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.config = config
        self.model_name = model_name
        self.draft_name = draft_name
        self.dtypes: dict[str, str] = dict(dtypes or {})
        self.cost = cost if cost is not None else CostModel()
        self.acceptance = acceptance if acceptance is not None else AcceptanceStats()
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.fallback_events: list[dict[str, Any]] = []
        self.health = WorkerHealth(self.kv, drafter is not None, config.drafter_retry_seconds,
                                   config.max_verifier_failures, self.fallback_events)
        self.pipeline = DraftPipeline(drafter.propose) if drafter is not None and config.overlap else None
        # pre-drafting: one group, its next round drafted on the same draft thread during its verify (predraft.py)
        self.predraft = (PreDrafter(self.pipeline, self.kv, self.health, vocab_size)
                         if self.pipeline is not None and config.predraft else None)
        self.overlap = engine_overlap(config.overlap, config.overlap_reason, config.predraft, drafter is not None)
        log.info("overlap %s (%s)%s", self.overlap["mode"] or "off", self.overlap["reason"],
                 f"; pre-drafting {self.overlap['predraft']}" if "predraft" in self.overlap else "")
        self._namespaces = [TARGET_NAMESPACE] + ([DRAFT_NAMESPACE] if drafter else [])
        self._turns_without_plans = 0  # overlap: consecutive turns in which no plan got a reservation
        self.inbox = RequestInbox(config.max_waiting)  # shared with submit/abort callers; step drains it
        self.shared = SharedPrompts(self.kv, self.inbox)  # prompt groups: n completions prefill once
        self.observer = observer  # traces, metrics: gets a StepRecord per step (step_record.py)
        self._record: StepRecord | None = None  # this step's, while an observer is attached
        self._fallbacks_seen = 0  # fallback events already handed to the observer

    # ------------------------------------------------------------------ requests in and out (any thread)
    def submit(self, request: GenerationRequest) -> None:
        """Validate and enqueue; raises InvalidRequestError / CapacityError at once, changing nothing."""
        state = new_request_state(request, self.tokenizer, self.eos_token_ids, self.vocab_size,
                                  self.config.max_context, has_drafter=self.drafter is not None)
        self.inbox.put(state, waiting=len(self.waiting))

    def submit_group(self, requests: list[GenerationRequest]) -> None:
        """The n completions of one prompt, all or none (raises like `submit`, changing nothing): the prompt is
        prefilled once and the others fork its KV (shared_prompts.py); each draws from its own seed."""
        states = [new_request_state(r, self.tokenizer, self.eos_token_ids, self.vocab_size, self.config.max_context,
                                    has_drafter=self.drafter is not None) for r in requests]
        if any(r.prompt_token_ids != requests[0].prompt_token_ids for r in requests):
            raise InvalidRequestError("prompt", "the completions of one group share one prompt")
        group = group_states(states)
        self.inbox.put_group(states, waiting=len(self.waiting), reserved=(group.key,) if group else ())

    def abort(self, request_id: str) -> None:
        self.inbox.abort(request_id)

    @contextmanager
    def unobserved(self) -> Iterator[None]:
        """Steps inside are not handed to the observer (warm-up: its rounds are not the users')."""
        observer, self.observer = self.observer, None
        try:
            yield
        finally:
            self.observer = observer

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.inbox.pending())

    # ------------------------------------------------------------------ the round (engine thread)
    def step(self) -> list[TokenChunk]:
        """One round (with overlap: one group's round while the other group's drafts are made)."""
        self._record = new_step_record() if self.observer is not None else None
        try:
            return self._step()
        finally:
            if self._record is not None:
                CURRENT_CARRIER.set(())
                self._deliver(self._record)
                self._record = None

    def _step(self) -> list[TokenChunk]:
        chunks = self._take_requests()
        self._admit()
        if not self.running:
            return chunks
        round_start = time.perf_counter()
        if self._ping_pong:  # plan, reserve, propose
            plans, draft_seconds = self._prepare_overlapped()
        else:
            plans, draft_seconds = self._prepare(self.running, may_preempt=True)
            if self.predraft is not None:  # the next round's drafts, made on the draft thread during the verify
                self.predraft.start(plans)
        if not plans:
            return chunks
        try:
            verified = self._verify(plans)
        except VerifierLost as lost:  # every request is requeued and re-prefills from its tokens
            self._recover_verifier(str(lost))
            return chunks
        if self.predraft is not None:
            draft_seconds += self._land_predrafts(plans)
        accept_start = time.perf_counter()
        with self._phase("accept"):
            outcome = accept_round(plans, verified.outputs, self.health.verifier_holder, self.health.drafter_holder)
        if self.predraft is not None:  # kept ones are the next round's drafts; dropped ones went back in the commit
            self.predraft.keep(outcome.predrafts_kept, outcome.predraft_results)
        self._commit(outcome)
        self.shared.after_commit(plans)  # prefillers' prefixes become their groups' shared prompts
        with self._phase("emit", chunks=len(outcome.chunks)):
            chunks.extend(self._emit(outcome))
        if self._record is not None:
            self._record_rounds(self._record, plans, outcome)
        now = time.perf_counter()
        add_round_times(self.totals, plans, draft_seconds, verified.seconds, now - accept_start, now - round_start)
        return chunks

    def _take_requests(self) -> list[TokenChunk]:
        """New requests join the queue; aborts apply, except for requests whose drafts are in flight (the
        drafter is writing their draft KV): those wait for their group to land."""
        in_flight = self.pipeline.in_flight_ids() if self.pipeline else set()
        states, aborts = self.inbox.drain(defer=in_flight)
        self.waiting.extend(states)
        return [chunk for rid in aborts for chunk in self._abort_now(rid)]

    def _admit(self) -> None:
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_batch:
            state = self.waiting[0]
            forked = self.shared.fork(state, cfg.k_max + 1, self.health.verifier_holder)  # a group's member
            if forked is False:
                break  # its group's prompt is being prefilled, or memory is short
            if forked is None:
                items = [AdmitItem(TARGET_NAMESPACE, state.request_id, state.token_ids, self.health.verifier_holder)]
                if not self.kv.can_admit(items, lookahead=cfg.k_max + 1):
                    break  # memory pressure: wait for running requests to finish
                (admission,) = self.kv.admit(items)
                state.target_cached = admission.num_cached_tokens
            self.waiting.popleft()
            state.admitted = True
            if state.admitted_at is None:
                state.admitted_at = time.monotonic()
            sizes = [sum(1 for r in self.running if r.group == g) for g in (0, 1)]
            state.group = 0 if sizes[0] <= sizes[1] else 1
            self.running.append(state)
            log.debug("admitted %s (%d prompt tokens, %d cached)", state.request_id, state.prompt_len,
                      state.target_cached)

    def _prepare(self, states: list[RequestState], may_preempt: bool) -> tuple[list[RoundPlan], float]:
        """Plan, reserve and propose on this thread (the drafter call waited for here)."""
        plans = self._reserve(self._plan(states), may_preempt=may_preempt)
        model_plans, batch = self._draft_batch(plans)
        if batch is None:
            return plans, 0.0
        start = time.perf_counter()
        try:
            with self._phase("draft.propose", requests=len(batch.items), k=max(p.k for p in model_plans)):
                result = self.drafter.propose(batch)  # type: ignore[union-attr]
            self._apply_drafts(model_plans, result)
        except Exception as exc:  # the drafter died: this round and the next ones decode plainly
            self._drafter_failed(model_plans, exc)
        return plans, time.perf_counter() - start

    def _prepare_overlapped(self) -> tuple[list[RoundPlan], float]:
        """This step's group lands (its drafts were made during the last verify); the other group is
        planned and reserved here and its drafter call is started, to run during this step's verify."""
        assert self.pipeline is not None
        turn = self.pipeline.next_turn()
        mine = [s for s in self.running if s.group == turn]
        others = [s for s in self.running if s.group != turn]
        flight = self.pipeline.take(turn)
        if flight is not None:
            plans, draft_seconds = self._land(flight)
        elif mine:  # nothing in flight for this group (its first turn, or after a recovery)
            plans, draft_seconds = self._prepare(mine, may_preempt=False)
        else:
            plans, draft_seconds = [], 0.0
        if others and not self.pipeline.has(1 - turn):
            other_plans = self._reserve(self._plan(others), may_preempt=False)
            model_plans, batch = self._draft_batch(other_plans)
            self.pipeline.submit(1 - turn, other_plans, model_plans, batch, self.health.drafter_holder)
        self._turns_without_plans = 0 if plans else self._turns_without_plans + 1
        idle = [s for s in self.running if s.request_id not in self.pipeline.in_flight_ids()]
        # out of blocks: no group reserved anything in a whole cycle (or the other group is empty)
        if not plans and idle and (not self.pipeline.busy() or self._turns_without_plans >= 2):
            self._preempt(idle[-1])
            self._turns_without_plans = 0
        return plans, draft_seconds

    def _land(self, flight: InFlight) -> tuple[list[RoundPlan], float]:
        """A group's drafts, applied on the engine thread; a failed call or a drafter epoch that changed
        since the batch was reserved (failure, retry, replacement) leaves the group to plain decoding."""
        if flight.future is None:
            return flight.plans, 0.0
        try:
            result, seconds = flight.future.result()
        except Exception as exc:
            self._drafter_failed(flight.model_plans, exc)
            return flight.plans, 0.0
        if self._record is not None:  # made on the draft thread during the last verify
            self._record.add_phase("draft.propose", seconds, requests=len(flight.model_plans), overlapped=True)
        if flight.drafter_holder != self.health.drafter_holder:
            self._plain(flight.model_plans, "drafter epoch changed while drafting: plain decoding")
            return flight.plans, seconds
        self._apply_drafts(flight.model_plans, result)
        return flight.plans, seconds

    @property
    def _ping_pong(self) -> bool:
        """Overlap by two groups (overlap.py), as opposed to none or pre-drafting's one group."""
        return self.pipeline is not None and self.predraft is None

    def _land_predrafts(self, plans: list[RoundPlan]) -> float:
        """This step's pre-drafts, made during the verify (predraft.py). A failed or replaced drafter voids the
        round's draft grants (its epoch expired; the drafts already verified stay verified), and every draft
        cache restarts."""
        assert self.predraft is not None
        landing = self.predraft.land()
        if landing.failure is not None:
            self.health.drafter_failed(landing.failure)
        if landing.lost:
            self._restart_draft_caches()
            void_draft_grants(plans)
        elif landing.seconds and self._record is not None:
            self._record.add_phase("draft.propose", landing.seconds, requests=sum(p.predraft is not None for p in plans),
                                   overlapped=True, predraft=True)
        return landing.seconds

    def _plan(self, states: list[RequestState]) -> list[RoundPlan]:
        cfg = self.config
        context = PlanContext(
            k_max=cfg.k_max, probe_every=cfg.probe_every, pressure_free_fraction=cfg.pressure_free_fraction,
            free_fraction=self.kv.free_fraction(TARGET_NAMESPACE) if any(  # read by auto only
                s.request.spec.k is None and s.request.spec.draft != "none" for s in states) else 1.0,
            drafter_usable=any(s.request.spec.draft == "model" for s in states) and self.health.drafter_usable(),
            engine_acceptance=self.acceptance, cost=self.cost, batch=len(states),
            nominal=nominal_costs(self.dtypes.get("target", "float32"), self.dtypes.get("draft")))
        def plan_one(state: RequestState) -> RoundPlan:
            return self.shared.prefill_plan(state, context.drafter_usable) or plan_request(state, context)

        # a kept pre-draft is its request's plan (predraft.py)
        plans = self.predraft.plans(states, plan_one) if self.predraft is not None else [plan_one(s) for s in states]
        for plan in plans:
            if plan.uses_model_drafter and not self._admit_draft(plan.state):
                self._plain([plan], "draft cache out of blocks")
            elif plan.uses_model_drafter:
                plan.draft_pending = plan.state.token_ids[plan.state.draft_cached:plan.prefill_to]
        if self.predraft is not None:  # fresh model-drafted plans reserve their pre-draft's slots too
            self.predraft.budget(plans, cfg.k_max, cfg.probe_every, context.nominal)
        return plans

    def _admit_draft(self, state: RequestState) -> bool:
        """Enter the request in the draft namespace (first speculative round, or after a drafter restart)."""
        if state.draft_admitted:
            return True
        try:
            (admission,) = self.kv.admit([AdmitItem(DRAFT_NAMESPACE, state.request_id, state.token_ids,
                                                    self.health.drafter_holder)])
        except KVError as exc:
            log.warning("draft admission refused for %s: %s", state.request_id, exc)
            return False
        state.draft_cached = admission.num_cached_tokens
        state.draft_admitted = True
        return True

    def _reserve(self, plans: list[RoundPlan], may_preempt: bool) -> list[RoundPlan]:
        """Each plan's maximum, in one call; a plan refused its target slots sits this round out."""
        health = self.health
        items = [ReserveItem(TARGET_NAMESPACE, p.state.request_id, len(p.target_pending) + p.k,
                             health.verifier_holder) for p in plans]
        items += [ReserveItem(DRAFT_NAMESPACE, p.state.request_id, len(p.draft_pending) + p.k - 1 + predraft_slots(p),
                              health.drafter_holder) for p in plans if p.uses_model_drafter and not p.predrafted]
        if not self._ping_pong:  # these plans are this step's (two groups: the other group's next step)
            self._carrier(plans)
        kv_start = time.perf_counter()
        with self._phase("kv.reserve", items=len(items)) as attributes:
            results = self.kv.reserve(items)  # carries the last round's held commit, if any
            attributes["refused"] = sum(isinstance(r, KVError) for r in results)
        self.totals["kv_seconds"] += time.perf_counter() - kv_start
        grants = {(r.namespace, r.request_id): r for r in results if not isinstance(r, KVError)}
        kept: list[RoundPlan] = []
        for plan in plans:
            rid = plan.state.request_id
            plan.target_grant = grants.get((TARGET_NAMESPACE, rid))
            draft = plan.draft_grant if plan.predrafted else grants.get((DRAFT_NAMESPACE, rid))  # a kept pre-draft's
            if plan.target_grant is None:
                if draft is not None:
                    self.kv.rollback([(DRAFT_NAMESPACE, rid)])
                continue  # out of blocks this round: skipped; preempted if nothing runs
            if plan.uses_model_drafter and draft is None:
                self._plain([plan], "draft cache out of blocks")
            plan.draft_grant = draft if plan.uses_model_drafter else None
            kept.append(plan)
        if not kept and plans and may_preempt:
            self._preempt(self.running[-1])
        return kept

    def _draft_batch(self, plans: list[RoundPlan]) -> tuple[list[RoundPlan], ProposeBatch | None]:
        model_plans = [p for p in plans if p.uses_model_drafter and p.k > 0 and not p.predrafted]
        if not model_plans:
            return model_plans, None
        # under overlap the batch drafts the other group's next round: it carries no trace of this step's
        carrier = self._carrier(plans) if not self._ping_pong else ()
        return model_plans, ProposeBatch([propose_item(p) for p in model_plans], carrier)

    def _apply_drafts(self, model_plans: list[RoundPlan], result: ProposeResult) -> None:
        if self.health.drafter_answered(result.worker_instance):
            # a new process drafted from an empty KV pool: worthless, so this round decodes plainly
            self._restart_draft_caches()
            self._plain(model_plans, "drafter replaced: re-prefilling its cache")
            return
        if all(len(p.draft_pending) <= 2 for p in model_plans):  # a catch-up prefill is not a draft step
            self.cost.observe_draft(max(p.k for p in model_plans), result.seconds)
        by_id = {o.request_id: o for o in result.outputs}
        refusal = self._invalid_drafts(model_plans, by_id)
        if refusal is not None:  # never trusted: the drafter is treated as failed, this round decodes plainly
            self._drafter_failed(model_plans, InvalidDrafts(refusal), "fallback: drafter returned invalid drafts")
            return
        for p in model_plans:
            out = by_id[p.state.request_id]
            p.drafts, p.draft_probs = out.draft_ids, out.draft_probs

    def _invalid_drafts(self, model_plans: list[RoundPlan], by_id: dict[str, Any]) -> str | None:
        """Why the drafter's answer cannot be used (None if it can): every planned request answered, with
        exactly k ids, each in [0, vocab_size), and draft probabilities (when sent) with one row per draft."""
        for p in model_plans:
            out = by_id.get(p.state.request_id)
            if out is None:
                return f"no drafts for {p.state.request_id}"
            if len(out.draft_ids) != p.k:
                return f"{p.state.request_id}: {len(out.draft_ids)} drafts, asked for k={p.k}"
            if any(not 0 <= int(t) < self.vocab_size for t in out.draft_ids):
                return f"{p.state.request_id}: draft ids outside [0, {self.vocab_size})"
            if out.draft_probs is not None and len(out.draft_probs) != p.k:
                return f"{p.state.request_id}: {len(out.draft_probs)} draft probability rows for k={p.k}"
        return None

    def _drafter_failed(self, model_plans: list[RoundPlan], exc: BaseException,
                        reason: str = "fallback: drafter failed, plain decoding") -> None:
        self.health.drafter_failed(exc)  # its epoch expired: every draft grant is gone
        self._restart_draft_caches()
        self._plain(model_plans, reason)

    @staticmethod
    def _plain(plans: list[RoundPlan], reason: str) -> None:
        for p in plans:
            p.uses_model_drafter, p.k, p.drafts, p.draft_probs, p.draft_grant = False, 0, [], None, None
            p.state.record_k(0, reason)

    def _verify(self, plans: list[RoundPlan]) -> VerifyResult:
        items = [verify_item(p) for p in plans]
        call_start = time.perf_counter()
        try:
            with self._phase("verify.forward", requests=len(items),
                             tokens=sum(len(i.input_ids) + len(i.draft_ids) for i in items)):
                result = self.verifier.verify(VerifyBatch(items, self._carrier(plans)))
        except Exception as exc:
            time.sleep(self.health.verifier_failed(exc))  # re-raises after too many failures in a row
            raise VerifierLost(f"verifier failed: {exc!r}") from exc
        if self.health.verifier_answered(result.worker_instance):
            raise VerifierLost("verifier replaced (new process, empty KV pool)")
        self.totals["verify_call_seconds"] += time.perf_counter() - call_start  # result.seconds + the hop
        self.cost.observe_verify(sum(len(i.input_ids) + len(i.draft_ids) for i in items), result.seconds)
        return result

    def _commit(self, outcome: RoundOutcome) -> None:
        for record in outcome.acceptance:
            self.acceptance.record(record.accepted, record.proposed, record.contract)
        for request_id in outcome.release_draft:
            self.kv.release(request_id, [DRAFT_NAMESPACE])
        kv_start = time.perf_counter()
        hold = not self._ping_pong and not outcome.finished  # held: sent with the next round's reserve
        with self._phase("kv.commit", items=len(outcome.commits), held=hold):
            self.kv.commit(outcome.commits, hold=hold)
        self.totals["kv_seconds"] += time.perf_counter() - kv_start

    def _emit(self, outcome: RoundOutcome) -> list[TokenChunk]:
        for state in outcome.finished:
            self.running.remove(state)
            self.inbox.forget(state.request_id)
        return outcome.chunks

    # ------------------------------------------------------------------ giving KV back (engine thread)
    def _check_commits(self, commits: list[CommitItem], results: list[Any]) -> None:
        """Outcomes of a commit whenever it reaches the ledger (held_commit.py)."""
        for item, res in zip(commits, results, strict=True):
            if not isinstance(res, KVError):
                continue
            if item.namespace == TARGET_NAMESPACE:
                raise res
            log.warning("draft commit refused for %s (%s); the drafter re-prefills it", item.request_id, res)
            for state in self.running:  # the ledger and our draft_cached disagree: start the draft cache over
                if state.request_id == item.request_id and state.draft_admitted:
                    self.kv.release(state.request_id, [DRAFT_NAMESPACE])
                    state.draft_cached, state.draft_admitted = 0, False

    def _restart_draft_caches(self) -> None:
        """The drafter's epoch changed: its grants are gone, so every request re-enters the draft namespace."""
        if self.predraft is not None:
            self.predraft.forget()
        for state in self.running:
            state.draft_cached, state.draft_admitted = 0, False
        self.shared.draft_lost()

    def _recover_verifier(self, reason: str) -> None:
        """The target KV is gone: groups in flight land first (their drafts are dropped), the verifier's epoch
        is renewed, and every running request gives back its draft cache and is requeued to re-prefill from
        its tokens (nothing emitted is lost; a waiting request holds nothing in the ledger)."""
        log.error("%s; re-prefilling %d running requests", reason, len(self.running))
        for flight in self.pipeline.drain() if self.pipeline is not None else []:
            failure = flight.future.exception() if flight.future is not None else None
            if failure is not None:  # the drafter failed meanwhile: its epoch expires as on any failure
                self.health.drafter_failed(failure)
        self.health.renew_verifier(reason)
        for state in reversed(self.running):
            self._note_rollback(state, f"verifier lost: {reason}")
            if state.draft_admitted:  # this round's draft reservation goes with it
                self.kv.release(state.request_id, [DRAFT_NAMESPACE])
            state.forget_kv()
            self.waiting.appendleft(state)
        self.running.clear()
        self.shared.target_lost(self.waiting)

    def _preempt(self, state: RequestState) -> None:
        """Give all of a request's KV back and requeue it; it re-prefills from its tokens (nothing is lost)."""
        log.warning("preempting %s: out of KV blocks", state.request_id)
        self._note_rollback(state, "preempted: out of KV blocks")
        self.kv.release(state.request_id, self._namespaces)
        self.running.remove(state)
        state.forget_kv()
        self.waiting.appendleft(state)
        self.fallback_events.append({"at": time.time(), "request_id": state.request_id, "event": "preempted"})

    def _abort_now(self, request_id: str) -> list[TokenChunk]:
        for state in list(self.running):
            if state.request_id == request_id:
                self.running.remove(state)
                self._note_rollback(state, "aborted")
                if not (FAULTS.active and FAULTS.take("engine.skip_abort_rollback") is not None):  # chaos control
                    self.kv.release(request_id, self._namespaces)
                self.shared.leave(state, self.waiting)  # a prefiller aborted during its group's prefill
                return [self._aborted_chunk(state)]
        for state in list(self.waiting):
            if state.request_id == request_id:  # a waiting request holds nothing in the ledger: nothing to release
                assert not (state.admitted or state.draft_admitted), f"waiting {request_id} holds KV"
                self.waiting.remove(state)
                self.shared.leave(state, self.waiting)
                return [self._aborted_chunk(state)]
        return []

    def _aborted_chunk(self, state: RequestState) -> TokenChunk:
        state.finish_reason = "abort"
        self.inbox.forget(state.request_id)
        return TokenChunk(state.request_id, [], "", finish_reason="abort", stats=state.stats(),
                          offset=state.num_output)

    # ------------------------------------------------------------------ observers (engine thread)
    def _phase(self, name: str, **attributes: Any) -> AbstractContextManager[dict[str, Any]]:
        return self._record.phase(name, **attributes) if self._record is not None else nullcontext(attributes)

    def _carrier(self, plans: list[RoundPlan]) -> tuple[tuple[str, str], ...]:
        """The W3C carrier the worker calls of this step continue (empty unless a traced request is in it)."""
        record = self._record
        if record is None:
            return ()
        if record.host_request is None and not record.carrier:
            traced = [(p.state.request_id, p.state.request.trace_context) for p in plans if p.state.request.trace_context]
            if traced:
                self.observer.begin(record, traced)  # type: ignore[union-attr]
                CURRENT_CARRIER.set(record.carrier)  # the KV client sends it with this step's ledger calls
        return record.carrier

    def _note_rollback(self, state: RequestState, reason: str) -> None:
        if self._record is not None:
            self._record.rollbacks.append(Rollback(state.request_id, state.request.trace_context, reason,
                                                   time.time_ns()))

    def _record_rounds(self, record: StepRecord, plans: list[RoundPlan], outcome: RoundOutcome) -> None:
        chunks = {chunk.request_id: chunk for chunk in outcome.chunks}
        record.batch_size = len(plans)
        for plan in plans:
            if plan.prefill_to is not None:  # a prompt group's prefill: no round of the request's own
                continue
            spec, chunk = plan.state.request.spec, chunks[plan.state.request_id]
            record.rounds.append(RoundRecord(
                plan.state.request_id, plan.state.request.trace_context, plan.k, len(plan.drafts), chunk.proposed,
                chunk.accepted,
                len(chunk.token_ids), spec.contract,
                "none" if plan.k == 0 else "model" if plan.uses_model_drafter else "ngram", chunk.finish_reason))

    def _deliver(self, record: StepRecord) -> None:
        record.fallbacks = [str(e.get("event", "unknown")) for e in self.fallback_events[self._fallbacks_seen:]]
        self._fallbacks_seen = len(self.fallback_events)
        if not (record.rounds or record.rollbacks or record.fallbacks or record.host is not None):
            return
        record.end_ns = time.time_ns()
        record.drafter = None if self.health.drafter_holder is None else str(self.health.drafter_holder)
        record.verifier = str(self.health.verifier_holder)
        try:
            self.observer.step(record)  # type: ignore[union-attr]
        except Exception:  # an observer's failure must not fail a round
            log.exception("engine observer failed; its step record is dropped")

    # ------------------------------------------------------------------ checks, statistics, shutdown
    def check_ledger(self) -> None:
        """Assert that the ledger holds entries only for running requests (in-flight ones included): none for a
        waiting or ended request, none at all once every request ended. One ledger call per namespace."""
        running = {state.request_id for state in self.running}
        in_flight = self.pipeline.in_flight_ids() if self.pipeline else set()
        assert in_flight <= running, f"in flight but not running: {sorted(in_flight - running)}"
        running |= self.shared.keys()  # the shared prompts of groups with members still to fork
        for namespace in self._namespaces:
            held = set(self.kv.request_ids(namespace))
            assert held <= running, f"{namespace}: the ledger holds {sorted(held - running)}, which are not running"

    def stats(self) -> dict[str, Any]:
        identity = {"model": self.model_name, "draft": self.draft_name, "dtype": dict(self.dtypes),
                    "running": len(self.running), "waiting": len(self.waiting) + self.inbox.queued()}
        overlap = self.overlap | ({"predraft": self.predraft.summary()} if self.predraft is not None else {})
        return engine_stats(identity, self.totals, self.acceptance, self.cost, self.fallback_events,
                            self.kv.free_fraction(TARGET_NAMESPACE), overlap)

    def reset_statistics(self) -> None:
        """Forget acceptance, time totals and events (after warm-up); the cost model stays."""
        self.acceptance = AcceptanceStats()
        self.totals = collections.defaultdict(float)
        self.fallback_events.clear()
        self._fallbacks_seen = 0

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


__all__ = ["InvalidDrafts", "SpecEngine", "VerifierLost"]
