"""Random sequences of admit / reserve / commit / rollback / release / fork / worker restarts.

Besides the ledger, the machine simulates the workers' KV memory: every granted slot is written
with the token it holds, copy-on-write and tree compaction are executed, and after every step each
live request's committed tokens must read back through its block table. Two owners of one block,
a missing copy on write or a wrong prefix hit would all show up as a wrong token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kv_manager import (
    BlockLedger,
    BlockState,
    CommitItem,
    ExceedsCapacity,
    Holder,
    InvalidCommit,
    KVError,
    NamespaceConfig,
    OutOfBlocks,
    RequestKey,
    Reservation,
    ReserveItem,
    StaleEpoch,
)

CONFIGS = (
    NamespaceConfig("verifier/target", num_blocks=24, block_size=4),
    NamespaceConfig("drafter/draft", num_blocks=12, block_size=2, prefix_caching=False),
)
NAMESPACES = tuple(config.name for config in CONFIGS)
WORKERS = ("w0", "w1")
BASES = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5, 5, 5, 5, 5, 5, 5, 5))  # share block 0 partly
TOKENS = st.integers(0, 3)


@dataclass
class ModelRequest:
    holder: Holder
    prompt: list[int]
    tokens: list[int]  # committed tokens: the truth
    pending: list[int] | None = None  # tokens written into the reserved slots of the round in flight


class KVLedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = BlockLedger(CONFIGS)
        self.holders = {worker: self.ledger.register_worker(worker) for worker in WORKERS}
        self.dead_holders: list[Holder] = []
        self.memory = {c.name: [[-1] * c.block_size for _ in range(c.num_blocks)] for c in CONFIGS}
        self.model: dict[RequestKey, ModelRequest] = {}
        self.next_id = 0

    def _keys(self, in_flight: bool | None = None) -> list[RequestKey]:
        return sorted(k for k, m in self.model.items() if in_flight is None or (m.pending is not None) == in_flight)

    def _write(self, namespace: str, slot: int, token: int) -> None:
        block_id, offset = divmod(slot, self.ledger.pools[namespace].block_size)
        self.memory[namespace][block_id][offset] = token

    def _read(self, namespace: str, slot: int) -> int:
        block_id, offset = divmod(slot, self.ledger.pools[namespace].block_size)
        return self.memory[namespace][block_id][offset]

    def _min_prefix_hit(self, namespace: str, prompt: list[int]) -> int:
        """Full blocks of `prompt` that a live request has committed: they must be hits."""
        bs = self.ledger.pools[namespace].block_size
        best = 0
        for (ns, _), m in self.model.items():
            if ns != namespace:
                continue
            blocks = 0
            while (blocks + 1) * bs <= len(m.tokens) and m.tokens[: (blocks + 1) * bs] == prompt[: (blocks + 1) * bs]:
                blocks += 1
            best = max(best, blocks)
        return min(best, (len(prompt) - 1) // bs) * bs

    def _admit(self, namespace: str, holder: Holder, prompt: list[int]) -> RequestKey:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        minimum = self._min_prefix_hit(namespace, prompt)
        admission = self.ledger.add_request(namespace, request_id, prompt, holder)
        pool = self.ledger.pools[namespace]
        cached = admission.num_cached_tokens
        assert cached % pool.block_size == 0 and cached <= (len(prompt) - 1) // pool.block_size * pool.block_size
        if pool.config.prefix_caching:
            assert cached >= minimum
            event("prefix hit", cached > 0)
        else:
            assert cached == 0
        self.model[(namespace, request_id)] = ModelRequest(holder, prompt, prompt[:cached])
        return (namespace, request_id)

    def _reserve(self, items: list[ReserveItem], atomic: bool, data: st.DataObject) -> None:
        before = self.ledger.snapshot()
        if atomic:
            try:
                outcomes: list[Reservation | KVError] = self.ledger.reserve(items, atomic=True)
            except (OutOfBlocks, ExceedsCapacity):
                assert self.ledger.snapshot() == before
                return
        else:
            outcomes = self.ledger.reserve(items)
        for item, outcome in zip(items, outcomes, strict=True):
            if isinstance(outcome, KVError):
                assert isinstance(outcome, (OutOfBlocks, ExceedsCapacity)), outcome
                assert self.ledger.reserved_len(item.namespace, item.request_id) == 0
                event("refused", type(outcome).__name__)
                continue
            self._worker_writes(item, outcome, data)

    def _worker_writes(self, item: ReserveItem, grant: Reservation, data: st.DataObject) -> None:
        """What the worker does with a grant: copy on write first, then write every granted slot."""
        namespace, m = item.namespace, self.model[(item.namespace, item.request_id)]
        pool = self.ledger.pools[namespace]
        assert grant.start_pos == len(m.tokens) and len(grant.slot_mapping) == item.num_new_slots
        assert grant.block_table == self.ledger.block_table(namespace, item.request_id)
        event("copy on write", bool(grant.copy_on_write))
        for source, target in grant.copy_on_write:
            self.memory[namespace][target] = list(self.memory[namespace][source])
        positions = range(grant.start_pos, grant.start_pos + item.num_new_slots)
        m.pending = [m.prompt[p] if p < len(m.prompt) else data.draw(TOKENS) for p in positions]
        for slot, token in zip(grant.slot_mapping, m.pending, strict=True):
            assert pool.blocks[slot // pool.block_size].ref_count == 1, "a write into a shared block"
            self._write(namespace, slot, token)

    def _commit(self, items: list[CommitItem]) -> None:
        tables = {(i.namespace, i.request_id): self.ledger.block_table(i.namespace, i.request_id) for i in items}
        for item, outcome in zip(items, self.ledger.commit(items), strict=True):
            assert not isinstance(outcome, KVError), outcome
            key = (item.namespace, item.request_id)
            event("dedupe", outcome.block_table != tables[key][: len(outcome.block_table)])
            event("tree compaction", bool(outcome.slot_moves))
            for source, target in outcome.slot_moves:
                self._write(item.namespace, target, self._read(item.namespace, source))
            self.model[key].tokens.extend(item.token_ids)
            self.model[key].pending = None
            assert outcome.committed_len == len(self.model[key].tokens)
            if item.finished:
                del self.model[key]

    def _prefill(self, keys: list[RequestKey], data: st.DataObject) -> None:
        """The engine's first round: reserve the uncached rest of each prompt, commit all of it."""
        items = [ReserveItem(*key, len(self.model[key].prompt) - len(self.model[key].tokens), self.model[key].holder)
                 for key in keys]
        self._reserve(items, atomic=True, data=data)
        granted = [key for key in keys if self.model[key].pending is not None]
        self._commit([CommitItem(*key, len(self.model[key].pending or ()), list(self.model[key].pending or ()),
                                 self.model[key].holder) for key in granted])

    @initialize(suffixes=st.lists(st.lists(TOKENS, max_size=6), min_size=1, max_size=3), data=st.data())
    def running_requests(self, suffixes: list[list[int]], data: st.DataObject) -> None:
        keys = [self._admit(NAMESPACES[0], self.holders[WORKERS[0]], [*BASES[0], *suffix]) for suffix in suffixes]
        self._prefill(keys, data)

    @rule(namespace=st.sampled_from(NAMESPACES), worker=st.sampled_from(WORKERS), base=st.sampled_from(BASES),
          suffix=st.lists(TOKENS, max_size=6), prefill=st.booleans(), data=st.data())
    def add_request(
        self, namespace: str, worker: str, base: tuple[int, ...], suffix: list[int], prefill: bool, data: st.DataObject
    ) -> None:
        key = self._admit(namespace, self.holders[worker], [*base, *suffix])
        if prefill:
            self._prefill([key], data)

    @rule(base=st.sampled_from(BASES), suffix=st.lists(TOKENS, max_size=6), data=st.data())
    def admit_twins(self, base: tuple[int, ...], suffix: list[int], data: st.DataObject) -> None:
        """Two identical prompts prefilled in one round: the second's full blocks dedupe to the first's."""
        namespace = NAMESPACES[0]
        prompt = [*base, *suffix]
        keys = [self._admit(namespace, self.holders[WORKERS[0]], prompt) for _ in range(2)]
        self._prefill(keys, data)
        if all(key in self.model and self.model[key].tokens == prompt for key in keys):
            num_full = len(prompt) // self.ledger.pools[namespace].block_size
            first, second = (self.ledger.block_table(*key)[:num_full] for key in keys)
            assert first == second

    @precondition(lambda self: self._keys(in_flight=False))
    @rule(data=st.data(), atomic=st.booleans())
    def reserve(self, data: st.DataObject, atomic: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(self._keys(in_flight=False)), min_size=1, max_size=4, unique=True))
        items = [ReserveItem(ns, rid, data.draw(st.integers(1, 9)), self.model[(ns, rid)].holder) for ns, rid in keys]
        self._reserve(items, atomic, data)

    @precondition(lambda self: self._keys(in_flight=True))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(self._keys(in_flight=True)), min_size=1, max_size=4, unique=True))
        items = []
        for namespace, request_id in keys:
            m = self.model[(namespace, request_id)]
            assert m.pending is not None
            accepted_len = data.draw(st.integers(0, len(m.pending)))
            path = None
            if accepted_len and data.draw(st.booleans()):
                offsets = st.lists(st.integers(0, len(m.pending) - 1), min_size=accepted_len, max_size=accepted_len,
                                   unique=True)
                path = sorted(data.draw(offsets))
            token_ids = [m.pending[o] for o in path] if path else m.pending[:accepted_len]
            finished = data.draw(st.integers(0, 9)) == 0
            items.append(CommitItem(namespace, request_id, accepted_len, token_ids, m.holder, path, finished))
        self._commit(items)

    @precondition(lambda self: self._keys(in_flight=True))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        namespace, request_id = data.draw(st.sampled_from(self._keys(in_flight=True)))
        self.ledger.rollback(namespace, request_id)
        self.model[(namespace, request_id)].pending = None

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        namespace, request_id = data.draw(st.sampled_from(self._keys()))
        self.ledger.release(namespace, request_id)
        del self.model[(namespace, request_id)]

    @precondition(lambda self: self._keys(in_flight=False))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        namespace, parent_id = data.draw(st.sampled_from(self._keys(in_flight=False)))
        child_id = f"r{self.next_id}"
        self.next_id += 1
        parent = self.model[(namespace, parent_id)]
        admission = self.ledger.fork(namespace, parent_id, child_id)
        assert admission.block_table == self.ledger.block_table(namespace, parent_id)
        self.model[(namespace, child_id)] = ModelRequest(parent.holder, parent.prompt, list(parent.tokens))
        if data.draw(st.booleans()):  # the child writes first: a shared partial block is copied
            self._reserve([ReserveItem(namespace, child_id, data.draw(st.integers(1, 5)), parent.holder)], False, data)

    @rule(worker=st.sampled_from(WORKERS))
    def restart_worker(self, worker: str) -> None:
        held = [key for key, m in self.model.items() if m.holder.worker_id == worker]
        self.dead_holders.append(self.holders[worker])
        assert self.ledger.expire_worker(worker) == len(held)
        for key in held:
            del self.model[key]
        self.holders[worker] = self.ledger.register_worker(worker)

    @precondition(lambda self: self.dead_holders and self.model)
    @rule(data=st.data())
    def late_call_from_dead_epoch(self, data: st.DataObject) -> None:
        namespace, request_id = data.draw(st.sampled_from(self._keys()))
        dead = data.draw(st.sampled_from(self.dead_holders))
        before = self.ledger.snapshot()
        outcomes = self.ledger.commit([CommitItem(namespace, request_id, 0, [], dead)])
        outcomes += self.ledger.reserve([ReserveItem(namespace, request_id, 1, dead)])
        assert all(isinstance(outcome, StaleEpoch) for outcome in outcomes)
        assert self.ledger.snapshot() == before

    @precondition(lambda self: self._keys(in_flight=False))
    @rule(data=st.data())
    def commit_without_reservation(self, data: st.DataObject) -> None:
        namespace, request_id = data.draw(st.sampled_from(self._keys(in_flight=False)))
        before = self.ledger.snapshot()
        [outcome] = self.ledger.commit([CommitItem(namespace, request_id, 0, [], self.model[(namespace, request_id)].holder)])
        assert isinstance(outcome, InvalidCommit)
        assert self.ledger.snapshot() == before

    @invariant()
    def blocks_are_consistent(self) -> None:
        for namespace, pool in self.ledger.pools.items():
            tables = [self.ledger.block_table(namespace, rid) for rid in self.ledger.request_ids(namespace)]
            holders = Counter(block_id for table in tables for block_id in table)
            states = Counter(block.state for block in pool.blocks)
            assert sum(states.values()) == pool.num_blocks
            assert states[BlockState.FREE] == pool.num_free
            assert set(pool.free_blocks) == {b.block_id for b in pool.blocks if b.state is BlockState.FREE}
            for block in pool.blocks:
                assert block.ref_count == holders[block.block_id], block  # no table holds a free block
        self.ledger.assert_no_leaks()

    @invariant()
    def committed_tokens_read_back(self) -> None:
        live = {(ns, rid) for ns in NAMESPACES for rid in self.ledger.request_ids(ns)}
        assert live == set(self.model)
        for (namespace, request_id), m in self.model.items():
            pool = self.ledger.pools[namespace]
            bs = pool.block_size
            table = self.ledger.block_table(namespace, request_id)
            assert self.ledger.committed_len(namespace, request_id) == len(m.tokens)
            assert self.ledger.reserved_len(namespace, request_id) == len(m.pending or ())
            assert [self._read(namespace, table[p // bs] * bs + p % bs) for p in range(len(m.tokens))] == m.tokens
            if pool.config.prefix_caching:  # every live full committed block is a prefix-cache entry
                for index in range(len(m.tokens) // bs):
                    block = pool.blocks[table[index]]
                    assert pool.hash_to_block.get(block.block_hash) == block.block_id

    def teardown(self) -> None:
        for namespace, request_id in list(self.model):
            self.ledger.release(namespace, request_id)
        report = self.ledger.audit()
        report.assert_no_leaks()
        assert all(counts.free == counts.capacity for counts in report.counts.values()), report.counts


TestKVLedgerStateMachine = KVLedgerMachine.TestCase
TestKVLedgerStateMachine.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
