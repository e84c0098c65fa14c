"""Admission: a request enters a KV namespace, and its state learns how much of it the cache already holds.

    admit_target   the ledger's admit in the target namespace (prefix-cache hits counted)  -> target_cached
    admit_draft    the same in the draft namespace (first model-drafted round, or after a drafter restart)
    forked         a prompt group's member forked from the group's entry (shared_prompts.py)
    running        admitted: the time of its first admission and its overlap group

With accept.py's `accept_round` (a round's outcome) and RequestState's own methods (`forget_kv`,
`forget_draft_kv`: KV given back), these are the only writers of a RequestState's token and cache fields
(tests/cluster/engine/test_writers.py checks it). Owner: the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE
from cluster.engine.held_commit import HeldCommitKV
from cluster.engine.request_state import RequestState
from kv_manager.errors import KVError
from kv_manager.schema import AdmitItem, Holder

log = logging.getLogger("specserve.engine")


def admit_target(kv: HeldCommitKV, state: RequestState, holder: Holder, lookahead: int) -> bool:
    """Enter `state` in the target namespace if the pool can hold it and its first round; False: it waits."""
    items = [AdmitItem(TARGET_NAMESPACE, state.request_id, state.token_ids, holder)]
    if not kv.can_admit(items, lookahead=lookahead):
        return False  # memory pressure: wait for running requests to finish
    if state.scores_prompt:  # it computes every prompt row: no prefix-cache hit (its first token alone fills no block)
        items = [AdmitItem(TARGET_NAMESPACE, state.request_id, state.token_ids[:1], holder)]
    (admission,) = kv.admit(items)
    state.target_cached = admission.num_cached_tokens
    return True


def admit_draft(kv: HeldCommitKV, state: RequestState, holder: Holder | None) -> bool:
    """Enter the request in the draft namespace (first speculative round, or after a drafter restart)."""
    if state.draft_admitted:
        return True
    try:
        (admission,) = kv.admit([AdmitItem(DRAFT_NAMESPACE, state.request_id, state.token_ids, holder)])
    except KVError as exc:
        log.warning("draft admission refused for %s: %s", state.request_id, exc)
        return False
    state.draft_cached = admission.num_cached_tokens
    state.draft_admitted = True
    return True


def forked(state: RequestState, prefix_len: int, namespaces: Sequence[str]) -> None:
    """`state` now holds its group's shared prompt (all but its last token) in `namespaces`."""
    state.target_cached = prefix_len
    if DRAFT_NAMESPACE in namespaces:
        state.draft_cached, state.draft_admitted = prefix_len, True


def running(state: RequestState, group: int) -> None:
    """`state` joins the running batch, in overlap group `group`."""
    state.admitted = True
    if state.admitted_at is None:
        state.admitted_at = time.monotonic()
    state.group = group


__all__ = ["admit_draft", "admit_target", "forked", "running"]
