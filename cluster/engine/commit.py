"""Accept and commit for SpecEngine: a round's outcome becomes tokens, chunks and ledger commits.

Without overlap, a round in which no request finished holds its commit for the next round's reserve
(cluster/engine/held_commit.py); otherwise it commits at once.

A mixin of SpecEngine (cluster/engine/engine.py), which owns every attribute used here; everything runs
on the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan
from kv_manager.errors import KVError
from kv_manager.schema import CommitItem, Holder
from specserve_types.api import TokenChunk
from specserve_types.round_messages import VerifyOutput

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
            kept, delta = s.append_tokens(out.tokens)
            finished = s.finish_reason is not None
            # out.tokens = accepted drafts + one correction/bonus; a stop (EOS, stop string, max_tokens) may
            # keep fewer. Only kept tokens exist: the accepted drafts after the stop are neither committed
            # nor counted, and a round cut inside its accepted drafts counts as having proposed only the
            # drafts up to the stop (all accepted): the drafts after it were never needed, not rejected.
            kept_accepted = min(out.accepted_len, len(kept))
            counted_proposed = proposed if len(kept) == len(out.tokens) else kept_accepted
            if proposed:
                s.acceptance.record(kept_accepted, counted_proposed, s.request.spec.contract)
                self.acceptance.record(kept_accepted, counted_proposed, s.request.spec.contract)
            target_len = len(plan.target_pending) + kept_accepted
            committed = plan.target_pending + plan.drafts[:kept_accepted]
            assert s.token_ids[s.target_cached:s.target_cached + target_len] == committed, "commit != kept tokens"
            commits.append(CommitItem(cfg.target_namespace, s.request_id, target_len, committed,
                                      self.verifier_holder, finished=finished))
            s.target_cached += target_len
            if plan.uses_model_drafter:  # the drafter wrote KV for its pending tokens and all drafts but the last
                draft_len = len(plan.draft_pending) + min(kept_accepted, proposed - 1)
                draft_committed = (plan.draft_pending + plan.drafts)[:draft_len]
                commits.append(CommitItem(cfg.draft_namespace, s.request_id, draft_len, draft_committed,
                                          self.drafter_holder, finished=finished))
                s.draft_cached += draft_len
            elif finished and s.draft_admitted:
                self.kv.release(s.request_id, [cfg.draft_namespace])
            assert s.target_cached <= len(s.token_ids) and s.draft_cached <= len(s.token_ids), "cache > tokens"
            chunk = TokenChunk(s.request_id, kept, delta, proposed=counted_proposed,
                               accepted=kept_accepted, finish_reason=s.finish_reason)
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
        """Outcomes of a commit whenever it reaches the ledger (cluster/engine/held_commit.py)."""
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
