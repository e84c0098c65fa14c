"""The engine's settings: `EngineConfig`, derived from `ClusterConfig` (cluster/serving/config.py), the one
place where defaults live; and the ledger namespaces of the two KV pools."""

from __future__ import annotations

from dataclasses import dataclass

from specserve_types.api import EXACT_RULES

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
    overlap: bool  # the drafter runs beside the verifier (decided by overlap_policy.py: own devices pay off)
    overlap_reason: str  # why overlap is on or off (engine stats, logged at start)
    predraft: bool  # under overlap: pre-draft each request's next round during its verify (predraft.py)
    tree_nodes: int  # most nodes of a suffix-drafted token tree (0: chains only; tree_policy.py)
    model_tree_nodes: int  # most nodes of a draft model's token tree (0: chains only; drafter_service/draft_tree.py)
    draft_stop_below: float  # auto greedy chains of a draft model stop after a draft below this probability
    reservation_windows: bool  # serial rounds grant the next round beside this one's verify (held_commit.py)
    draft_lookup: bool  # auto: a model-drafted request drafts from an n-gram lookup where it pays more (planner.py)
    exact_rule: str  # the exact contract's rule for sampled chains (verifier_service/contracts.py)
    constrain_drafts: bool  # a draft model drafts a constrained request's chain under its constraint (masked q)

    def __post_init__(self) -> None:
        problems = [name for name, ok in (
            ("max_batch", self.max_batch >= 1), ("max_waiting", self.max_waiting >= 1),
            ("max_context", self.max_context >= 1), ("k_max", self.k_max >= 0),
            ("probe_every", self.probe_every >= 1),
            ("pressure_free_fraction", 0.0 <= self.pressure_free_fraction <= 1.0),
            ("drafter_retry_seconds", self.drafter_retry_seconds >= 0.0),
            ("max_verifier_failures", self.max_verifier_failures >= 0),
            ("overlap", isinstance(self.overlap, bool)), ("predraft", isinstance(self.predraft, bool)),
            ("reservation_windows", isinstance(self.reservation_windows, bool)),
            ("draft_lookup", isinstance(self.draft_lookup, bool)),
            ("constrain_drafts", isinstance(self.constrain_drafts, bool)),
            ("exact_rule", self.exact_rule in EXACT_RULES),
            ("tree_nodes", self.tree_nodes >= 0), ("model_tree_nodes", self.model_tree_nodes >= 0),
            ("draft_stop_below", 0.0 <= self.draft_stop_below <= 1.0),
        ) if not ok]
        if problems:
            raise ValueError(f"invalid EngineConfig field(s) {problems}: {self}")
