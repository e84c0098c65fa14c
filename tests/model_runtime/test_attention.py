"""Row-invariant paged attention (model_runtime/attention.py): a row's output is bitwise the same whether it is
computed alone (plain decoding: one row, keys up to its own position) or among others (a verify of k+1 rows,
a prefill, other sequences of a batch), in float32 and bfloat16; and it equals the textbook attention (fp32
SDPA) to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runtime import cpu_kernels
from model_runtime.attention import (
    TILE,
    WidthGroup,
    _group,
    _lone_group,
    _seq_rows_by_width,
    paged_attention,
    plan_attention,
)

HEADS, KV_HEADS, D = 12, 2, 64


def causal_mask(past: int, n: int) -> torch.Tensor:
    return torch.cat([torch.ones(n, past, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)


def causal_plan(past: int, n: int, slots: torch.Tensor, offset: int = 0) -> tuple[WidthGroup, ...]:
    return plan_attention([(offset, slots, causal_mask(past, n))])


def pool(length: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(length + 7, KV_HEADS, D, generator=g).to(dtype)  # a few slots the sequence does not own
    v = torch.randn(length + 7, KV_HEADS, D, generator=g).to(dtype)
    slots = torch.randperm(length + 7, generator=g)[:length]  # a sequence's slots are scattered in the pool
    return k, v, slots


def alone(q_row: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Plain decoding of that token: one row seeing exactly its own prefix."""
    return paged_attention(q_row[None], k, v, causal_plan(slots.shape[0] - 1, 1, slots))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_bitwise_alone_and_among_others(dtype: torch.dtype) -> None:
    checked = 0
    for seed, (past, n) in enumerate([(0, 1), (0, 9), (3, 2), (60, 5), (62, 4), (127, 9), (200, 17), (0, 70),
                                      (500, 9), (1000, 33)]):
        k, v, slots = pool(past + n, dtype, seed)
        q = torch.randn(n, HEADS, D, generator=torch.Generator().manual_seed(100 + seed)).to(dtype)
        together = paged_attention(q, k, v, causal_plan(past, n, slots))
        for i in range(n):
            assert torch.equal(alone(q[i], k, v, slots[:past + i + 1]), together[i]), (dtype, past, n, i)
            checked += 1
    assert checked > 150


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_bitwise_in_a_batch_of_sequences(dtype: torch.dtype) -> None:
    """Twelve sequences in one forward (decodes, verifies of 3..9 rows, a prefill), widths shared across
    sequences: each row equals that token decoded alone."""
    shapes = [(40, 1), (41, 1), (100, 5), (10, 9), (0, 30), (63, 1), (62, 3), (130, 1), (700, 9), (5, 2),
              (64, 1), (120, 8)]
    k_all, v_all, seqs, qs = [], [], [], []
    base = 0
    for seed, (past, n) in enumerate(shapes):
        k, v, slots = pool(past + n, dtype, 40 + seed)
        k_all.append(k)
        v_all.append(v)
        seqs.append((sum(s[1] for s in shapes[:seed]), slots + base, causal_mask(past, n)))
        qs.append(torch.randn(n, HEADS, D, generator=torch.Generator().manual_seed(80 + seed)).to(dtype))
        base += k.shape[0]
    k, v, q = torch.cat(k_all), torch.cat(v_all), torch.cat(qs)
    groups = plan_attention(seqs)
    assert any(g.rows.shape[0] > 1 for g in groups)  # some width is shared by several sequences
    together = paged_attention(q, k, v, groups)
    for (offset, slots, _mask), (past, n) in zip(seqs, shapes, strict=True):
        for i in range(n):
            assert torch.equal(alone(q[offset + i], k, v, slots[:past + i + 1]), together[offset + i]), (past, n, i)


def test_matches_sdpa_in_float32() -> None:
    past, n = 90, 6
    k, v, slots = pool(past + n, torch.float32, 3)
    q = torch.randn(n, HEADS, D, generator=torch.Generator().manual_seed(4))
    mask = causal_mask(past, n)
    ours = paged_attention(q, k, v, plan_attention([(0, slots, mask)]))
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k[slots].transpose(0, 1), v[slots].transpose(0, 1),
                                         attn_mask=mask, enable_gqa=True).transpose(0, 1)
    assert (ours - ref).abs().max().item() < 1e-5


def test_tree_mask_rows_see_only_their_ancestors() -> None:
    """A token tree: row 2 sees the past, row 0 and itself (not row 1): equal to a chain of those tokens."""
    past = 10
    k, v, slots = pool(past + 3, torch.float32, 5)
    q = torch.randn(3, HEADS, D, generator=torch.Generator().manual_seed(6))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, past, dtype=torch.bool), tree], dim=1)
    out = paged_attention(q, k, v, plan_attention([(0, slots, mask)]))
    chain_slots = torch.cat([slots[:past + 1], slots[past + 2:past + 3]])
    assert (out[2] - alone(q[2], k, v, chain_slots)).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_equal_their_chains_bitwise_across_key_chunks(dtype: torch.dtype) -> None:
    """A 24-node tree after 45 past tokens (its nodes span the kernel's chunks of 32 key positions, their ancestors
    scattered among non-ancestors): each node's row is bitwise the row of its chain (the past and its ancestors)
    decoded alone, as greedy trees need. The libraries' products (SPECSERVE_CPU_KERNEL=onednn: bounded, not exact)
    reduce over the masked width and are checked to rounding, as the tree test above."""
    exact = cpu_kernels.for_dtype(dtype).exact
    past, nodes = 45, 24
    g = torch.Generator().manual_seed(11)
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, nodes)]
    tree = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parent[j]
    k, v, slots = pool(past + nodes, dtype, 12)
    q = torch.randn(nodes, HEADS, D, generator=torch.Generator().manual_seed(13)).to(dtype)
    mask = torch.cat([torch.ones(nodes, past, dtype=torch.bool), tree], dim=1)
    out = paged_attention(q, k, v, plan_attention([(0, slots, mask)]))
    for i in range(nodes):
        chain = torch.cat([slots[:past], slots[past:][tree[i]]])
        ref = alone(q[i], k, v, chain)
        if exact:
            assert torch.equal(out[i], ref), (dtype, i)
        else:
            assert (out[i].float() - ref.float()).abs().max().item() < (1e-6 if dtype == torch.float32 else 2e-2), i


def test_plan_groups_rows_by_padded_key_width() -> None:
    slots = torch.arange(TILE + 3)
    groups = causal_plan(TILE - 2, 5, slots, offset=4)  # rows see 63, 64 | 65, 66, 67 keys
    assert [(g.width, g.rows.tolist()) for g in groups] == [(TILE, [[4, 5]]), (2 * TILE, [[6, 7, 8]])]
    assert groups[1].slots.shape == (1, 2 * TILE) and set(groups[1].slots.flatten().tolist()) <= set(slots.tolist())
    two = plan_attention([(0, torch.arange(10), causal_mask(9, 1)), (1, torch.arange(20, 33), causal_mask(10, 3))])
    (g,) = two
    assert g.rows.tolist() == [[0, 0, 0], [1, 2, 3]] and g.real.tolist() == [True, False, False, True, True, True]


def assert_same_group(a: WidthGroup, b: WidthGroup) -> None:
    assert (a.width, a.all_real, a.whole) == (b.width, b.all_real, b.whole)
    for name in ("slots", "rows", "hidden", "real", "real_rows"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("seqs", [[(0, 1)], [(TILE - 1, 1)], [(TILE - 2, 5)], [(130, 9)], [(9, 1), (10, 3)],
                                  [(TILE - 2, 5), (0, 2), (200, 17)], [(3 * TILE, 1)] * 4])
def test_a_causal_chain_planned_from_its_row_count_is_its_masks_plan(seqs: list[tuple[int, int]]) -> None:
    """model_runtime/batch.py plans a causal sequence from its row count: the plan equals its mask's, tensor for
    tensor, alone and among other sequences (rows crossing a width boundary, several groups, padding)."""
    g = torch.Generator().manual_seed(len(seqs))
    by_mask, by_count, offset = [], [], 0
    for past, n in seqs:
        slots = torch.randperm(4096, generator=g)[:past + n]
        by_mask.append((offset, slots, causal_mask(past, n)))
        by_count.append((offset, slots, n))
        offset += n
    planned, expected = plan_attention(by_count), plan_attention(by_mask)
    assert len(planned) == len(expected)
    for a, b in zip(planned, expected, strict=True):
        assert_same_group(a, b)


@pytest.mark.parametrize("offset", [0, 3])
def test_one_sequence_s_rows_of_a_width_are_grouped_as_the_padded_groups_are(offset: int) -> None:
    """A width with one sequence takes `_lone_group` (no padding): the tensors `_group` builds, for a causal mask
    and a tree's (rows that do not see every row before them), `whole` only where its rows are the forward's."""
    g = torch.Generator().manual_seed(offset)
    tree = torch.ones(6, 6, dtype=torch.bool).tril()
    tree[3, 1:3] = False  # row 3 hangs off row 0
    tree[5, 3:5] = False
    for mask in (causal_mask(TILE - 3, 6), torch.cat([torch.ones(6, TILE - 3, dtype=torch.bool), tree], dim=1)):
        slots = torch.randperm(4096, generator=g)[:mask.shape[1]]
        for total in (offset + 6, offset + 9):
            for width, s, rows, visible in _seq_rows_by_width(offset, slots, mask):
                assert_same_group(_lone_group(width, (s, rows, visible), total),
                                  _group(width, [(s, rows, visible)], total))
