"""The moves of prompt groups (prompt_group.py): n completions of one request prefill their prompt once.

    submit_group  -> group_states: one PromptGroup, its first member the prefiller
    admit         -> fork: a member whose group's prompt is ready is forked from the group's entry (no prefill)
    plan          -> prefill_plan: the prefiller's first round writes the KV of the prompt but its last token
    commit        -> after_commit: the prefiller's prefix is forked into the group's own entry (`key`)
    abort         -> leave: an unforked member goes; a prefiller hands its role to the next member waiting
    KV lost       -> target_lost / draft_lost: the group's entry went with the worker's epoch

The group's entry is released when its last member is forked or has gone. Owner: the engine thread
(docs/ARCHITECTURE.md §3); `group_states` runs in `submit` on fresh states no one else sees yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cluster.engine.admission import forked
from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE
from cluster.engine.held_commit import HeldCommitKV
from cluster.engine.inbox import RequestInbox
from cluster.engine.prompt_group import PromptGroup, group_key
from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan
from kv_manager.schema import AdmitItem, Holder


def group_states(states: Sequence[RequestState]) -> PromptGroup | None:
    """Make `states` (the n completions of one prompt) a group; None where sharing saves nothing (one
    member, or a one-token prompt: each member computes the last prompt token itself)."""
    if len(states) < 2 or states[0].prompt_len < 2 or states[0].request.sampling.prompt_logprobs is not None:
        return None  # a scored prompt is computed by each member (its rows are the member's first round's)
    group = PromptGroup(group_key(states[0].request_id), states[0].prompt_len - 1, len(states),
                        states[0].request_id)
    for state in states:
        state.prompt_group = group
    return group


def is_prefiller(state: RequestState) -> bool:
    group = state.prompt_group
    return group is not None and group.prefiller_id == state.request_id


class SharedPrompts:
    def __init__(self, kv: HeldCommitKV, inbox: RequestInbox) -> None:
        self.kv = kv
        self.inbox = inbox
        self.holding: dict[str, PromptGroup] = {}  # key -> group, while the key has a ledger entry

    def keys(self) -> set[str]:
        return set(self.holding)

    # ------------------------------------------------------------------ admission
    def fork(self, state: RequestState, lookahead: int, verifier_holder: Holder) -> bool | None:
        """None: `state` is admitted as usual (no group, or its prefiller). False: it waits (its group's prompt
        is being prefilled, or the pool cannot hold its first round now). True: forked from the group's entry:
        it holds the shared prompt but its last token, in every namespace the entry has."""
        group = state.prompt_group
        if group is None or group.prefiller_id == state.request_id:
            return None
        if not group.namespaces:
            return False
        own = AdmitItem(TARGET_NAMESPACE, state.request_id, state.token_ids[group.prefix_len:], verifier_holder)
        if not self.kv.can_admit([own], lookahead):
            return False
        self.kv.fork([(namespace, group.key, state.request_id) for namespace in group.namespaces])
        forked(state, group.prefix_len, group.namespaces)
        self._forked(state)
        return True

    # ------------------------------------------------------------------ the prefiller's round
    def prefill_plan(self, state: RequestState, drafter_usable: bool) -> RoundPlan | None:
        """The prefiller's prefill-only plan (None for any other state). A model-drafted group also fills the
        draft cache: one draft step (k=1) writes the prefix's draft KV; its draft is never verified."""
        group = state.prompt_group
        if group is None or group.prefiller_id != state.request_id:
            return None
        if state.target_cached >= group.prefix_len:  # a prefix-cache hit covers it: nothing to prefill
            self._hold(state, with_draft=False)
            return None
        spec = state.request.spec
        drafted = spec.draft == "model" and spec.k != 0 and drafter_usable
        return RoundPlan(state=state, k=1 if drafted else 0, uses_model_drafter=drafted, prefill_to=group.prefix_len,
                         target_pending=state.token_ids[state.target_cached:group.prefix_len])

    def after_commit(self, plans: Iterable[RoundPlan]) -> None:
        """Prefillers whose prefill committed this round: their prefix becomes the group's entry."""
        for plan in plans:
            if plan.prefill_to is not None and plan.state.target_cached == plan.prefill_to:
                self._hold(plan.state, with_draft=plan.uses_model_drafter)

    def _hold(self, prefiller: RequestState, with_draft: bool) -> None:
        group = prefiller.prompt_group
        assert group is not None and group.prefiller_id == prefiller.request_id
        self.kv.send_held()  # a held commit reaches the ledger first (a refused draft commit restarts the cache)
        namespaces = [TARGET_NAMESPACE]
        if with_draft and prefiller.draft_admitted and prefiller.draft_cached == group.prefix_len:
            namespaces.append(DRAFT_NAMESPACE)
        group.prefiller_id = None
        self._forked(prefiller)
        if group.unforked:  # someone still needs it
            self.kv.fork([(namespace, prefiller.request_id, group.key) for namespace in namespaces])
            group.namespaces = tuple(namespaces)
            self.holding[group.key] = group

    # ------------------------------------------------------------------ members going, KV lost
    def leave(self, state: RequestState, waiting: Iterable[RequestState]) -> None:
        """`state` ended before it was forked (aborted): a prefiller hands its role to the first member waiting."""
        group = state.prompt_group
        if group is None:
            return
        if group.prefiller_id == state.request_id:
            group.prefiller_id = next((s.request_id for s in waiting if s.prompt_group is group and s is not state),
                                    None)
        self._forked(state)

    def target_lost(self, waiting: Sequence[RequestState]) -> None:
        """The verifier's epoch expired and every group entry with it (it holds the target namespace): each
        group prefills again, carried by its first member waiting. Call once the running are requeued."""
        for group in list(self.holding.values()):
            if DRAFT_NAMESPACE in group.namespaces:
                self.kv.release(group.key, [DRAFT_NAMESPACE])
            self._drop(group)
            group.prefiller_id = next(s.request_id for s in waiting if s.prompt_group is group)

    def draft_lost(self) -> None:
        """The drafter's epoch expired: the groups' draft entries are gone (members re-prefill their draft)."""
        for group in self.holding.values():
            group.namespaces = tuple(ns for ns in group.namespaces if ns != DRAFT_NAMESPACE)

    def _forked(self, state: RequestState) -> None:
        group = state.prompt_group
        assert group is not None
        state.prompt_group = None
        group.unforked -= 1
        if group.unforked == 0:  # the last member: the shared entry goes, and its key is free again
            if group.namespaces:
                self.kv.release(group.key, group.namespaces)
            self._drop(group)
            self.inbox.forget(group.key)

    def _drop(self, group: PromptGroup) -> None:
        group.namespaces = ()
        self.holding.pop(group.key, None)
