"""Accept and commit for SpecEngine: a round's outcome becomes tokens, chunks and ledger commits.

Without overlap, a round in which no request finished holds its commit for the next round's reserve
(cluster/held_commit.py); otherwise it commits at once.

A mixin of SpecEngine (cluster/engine.py), which owns every attribute used here; everything runs
on the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from cluster.api import TokenChunk
from cluster.request_state import RequestState
from cluster.round_messages import VerifyOutput
from cluster.round_plan import RoundPlan
from kv_manager.errors import KVError
from kv_manager.schema import CommitItem, Holder

log = logging.getLogger("specserve.engine")


class RoundCommit:
    kv: Any
    config: Any
    acceptance: Any
    running: list[RequestState]
    totals: dict[str, float]
    verifier_holder: Holder
    drafter_holder: Holder | None
    _forget: Any

    def _accept_and_commit(self, plans: list[RoundPlan], outputs: list[VerifyOutput]) -> list[TokenChunk]:
        cfg = self.config
        commits: list[CommitItem] = []
        chunks: list[TokenChunk] = []
        for plan, out in zip(plans, outputs, strict=True):
            s = plan.state
            assert out.request_id == s.request_id
            proposed = len(plan.drafts)
            s.rounds += 1
            if proposed:
                s.acceptance.record(out.accepted_len, proposed, s.request.spec.contract)
                self.acceptance.record(out.accepted_len, proposed, s.request.spec.contract)
            accepted = plan.drafts[:out.accepted_len]
            target_len = len(plan.target_pending) + out.accepted_len
            kept, delta = s.append_tokens(out.tokens)
            finished = s.finish_reason is not None
            commits.append(CommitItem(cfg.target_namespace, s.request_id, target_len,
                                      plan.target_pending + accepted, self.verifier_holder, finished=finished))
            s.target_cached += target_len
            if plan.uses_model_drafter:
                draft_len = len(plan.draft_pending) + min(out.accepted_len, proposed - 1)
                commits.append(CommitItem(cfg.draft_namespace, s.request_id, draft_len,
                                          (plan.draft_pending + plan.drafts)[:draft_len], self.drafter_holder,
                                          finished=finished))
                s.draft_cached += draft_len
            elif finished and s.draft_admitted:
                self.kv.release(s.request_id, [cfg.draft_namespace])
            chunk = TokenChunk(s.request_id, kept, delta, proposed=proposed,
                               accepted=min(out.accepted_len, len(kept)), finish_reason=s.finish_reason)
            if finished:
                chunk.stats = s.stats()
                self.running.remove(s)
                self._forget(s.request_id)
            chunks.append(chunk)
        kv_start = time.perf_counter()
        hold = not self.config.overlap and not any(c.finished for c in chunks)
        self.kv.commit(commits, hold=hold)  # held: sent with the next round's reserve
        self.totals["kv_seconds"] += time.perf_counter() - kv_start
        return chunks

    def _check_commits(self, commits: Sequence[CommitItem], results: Sequence[Any]) -> None:
        """Outcomes of a commit whenever it reaches the ledger (cluster/held_commit.py)."""
        for item, res in zip(commits, results, strict=True):
            if not isinstance(res, KVError):
                continue
            if item.namespace == self.config.target_namespace:
                raise res
            log.warning("draft commit refused for %s (%s); the drafter re-prefills it", item.request_id, res)
            for state in self.running:  # the ledger and our draft_cached disagree: start the draft cache over
                if state.request_id == item.request_id and state.draft_admitted:
                    self.kv.release(state.request_id, [self.config.draft_namespace])
                    state.draft_cached, state.draft_admitted = 0, False
