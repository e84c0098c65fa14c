"""Acceptance bookkeeping of speculative rounds (pure Python, mergeable across requests, workers and runs).

Glossary:
  round        one verify of k >= 0 draft tokens for one request; it emits accepted_len + 1 tokens.
  reached[i]   rounds that proposed at least i+1 drafts (draft position i+1 existed).
  survived[i]  of those, rounds whose first i+1 drafts were all accepted.
  s_k          survived[k-1] / reached[k-1]: the probability that the first k drafts all survive,
               measured per position (never derived from a single i.i.d. acceptance rate).
  rejections   rounds that rejected a draft (accepted_len < proposed); with `accepted` it gives the
               per-draft acceptance rate accepted / (accepted + rejections), which the auto policy
               uses only to extrapolate to positions it has not measured yet.
  tree rounds  rounds whose drafts were a token tree (suffix drafting): `proposed` counts the tree's depth (the
               chain it stands for), `tree_nodes` its nodes; `accepted_by_rank[r]` = accepted nodes that were
               their parent's r-th candidate (0: the proposer's first choice, which a chain would have held).
  E[Y]         expected tokens per round at k = gamma: 1 + sum_{k=1..gamma} s_k (docs/contracts.md);
               `mean_tokens_per_round` is the measured mean over the rounds actually run (mixed k).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _add(a: list[int], b: list[int]) -> list[int]:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]


@dataclass
class AcceptanceStats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0
    accepted_len_histogram: list[int] = field(default_factory=list)  # index = accepted_len
    reached: list[int] = field(default_factory=list)  # index i = draft position i+1
    survived: list[int] = field(default_factory=list)
    rounds_by_contract: dict[str, int] = field(default_factory=dict)
    tree_rounds: int = 0
    tree_nodes: int = 0
    accepted_by_rank: list[int] = field(default_factory=list)

    def record(self, accepted_len: int, proposed: int, contract: str, ranks: tuple[int, ...] = (),
               tree_nodes: int = 0) -> None:
        """Count one round that proposed `proposed` drafts and accepted the first `accepted_len` of them; a tree
        round also gives its node count and its accepted nodes' sibling ranks."""
        assert 0 <= accepted_len <= proposed, f"accepted {accepted_len} of {proposed} proposed"
        if tree_nodes:
            self.tree_rounds += 1
            self.tree_nodes += tree_nodes
            for rank in ranks:
                self.accepted_by_rank = _add(self.accepted_by_rank, [0] * rank + [1])
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted_len
        self.rejections += int(accepted_len < proposed)
        self.accepted_len_histogram = _add(self.accepted_len_histogram, [0] * accepted_len + [1])
        self.reached = _add(self.reached, [1] * proposed)
        self.survived = _add(self.survived, [1] * accepted_len)
        self.rounds_by_contract[contract] = self.rounds_by_contract.get(contract, 0) + 1

    def survival(self) -> list[float]:
        """[s_1, ..., s_K] for every draft position K that some round reached."""
        survived = self.survived + [0] * (len(self.reached) - len(self.survived))
        return [s / r for s, r in zip(survived, self.reached, strict=True)]

    def expected_tokens_per_round(self, gamma: int) -> float:
        """E[Y] = 1 + sum_{k=1..gamma} s_k from the measured survivals (positions never reached count as 0)."""
        return 1.0 + sum(self.survival()[:gamma])

    @property
    def mean_tokens_per_round(self) -> float:
        """Measured E[Y]: tokens emitted per round (accepted drafts + one correction or bonus each)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        """A new AcceptanceStats counting the rounds of both."""
        contracts = dict(self.rounds_by_contract)
        for name, count in other.rounds_by_contract.items():
            contracts[name] = contracts.get(name, 0) + count
        return AcceptanceStats(
            rounds=self.rounds + other.rounds,
            proposed=self.proposed + other.proposed,
            accepted=self.accepted + other.accepted,
            rejections=self.rejections + other.rejections,
            accepted_len_histogram=_add(self.accepted_len_histogram, other.accepted_len_histogram),
            reached=_add(self.reached, other.reached),
            survived=_add(self.survived, other.survived),
            rounds_by_contract=contracts,
            tree_rounds=self.tree_rounds + other.tree_rounds,
            tree_nodes=self.tree_nodes + other.tree_nodes,
            accepted_by_rank=_add(self.accepted_by_rank, other.accepted_by_rank),
        )

    def speculative_decoding(self) -> dict:
        """The per-request figures in vLLM's shape (`metrics.speculative_decoding` in OpenAI responses): a spec
        step is a round that proposed drafts; mean acceptance length = 1 + accepted drafts per step (the
        tokens a step yields); `acceptance_histogram[i]` = steps that accepted exactly i drafts."""
        steps = self.rounds
        return {
            "num_spec_steps": steps,
            "num_draft_tokens": self.proposed,
            "num_accepted_draft_tokens": self.accepted,
            "draft_acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": 1.0 + self.accepted / steps if steps else 0.0,
            "acceptance_histogram": list(self.accepted_len_histogram),
        }

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "rejections": self.rejections,
            "acceptance_rate": self.acceptance_rate,
            "mean_tokens_per_round": self.mean_tokens_per_round,
            "accepted_len_histogram": list(self.accepted_len_histogram),
            "reached": list(self.reached),
            "survived": list(self.survived),
            "survival": self.survival(),
            "rounds_by_contract": dict(self.rounds_by_contract),
            "tree_rounds": self.tree_rounds,
            "tree_nodes": self.tree_nodes,
            "accepted_by_rank": list(self.accepted_by_rank),
        }

    @classmethod
    def from_dict(cls, data: dict) -> AcceptanceStats:
        """Inverse of `to_dict` (derived fields are recomputed, not read)."""
        return cls(
            rounds=data["rounds"],
            proposed=data["proposed"],
            accepted=data["accepted"],
            rejections=data.get("rejections", 0),
            accepted_len_histogram=list(data["accepted_len_histogram"]),
            reached=list(data["reached"]),
            survived=list(data["survived"]),
            rounds_by_contract=dict(data["rounds_by_contract"]),
            tree_rounds=data.get("tree_rounds", 0),
            tree_nodes=data.get("tree_nodes", 0),
            accepted_by_rank=list(data.get("accepted_by_rank", [])),
        )
