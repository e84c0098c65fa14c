"""Small-row linears: equal to F.linear within fp32 rounding, and a row's result does not depend on the
values of the rows that came with it (bitwise): another request in the batch never perturbs yours."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runtime import small_matmul
from model_runtime.small_matmul import SMALL_ROWS, best_splits, calibrate, linear


@pytest.mark.parametrize("shape", [(96, 64), (40, 200), (300, 48)])
def test_rows_are_independent_of_their_batch(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    x = torch.randn(SMALL_ROWS + 4, shape[1], generator=gen)
    calibrate(weight)
    for rows in range(1, SMALL_ROWS + 1):
        together = linear(x[:rows], weight, bias)
        assert together.shape == (rows, shape[0]) and together.is_contiguous()
        assert (together - F.linear(x[:rows], weight, bias)).abs().max().item() < 1e-4
        for i in range(rows):
            others = torch.randn(rows, shape[1], generator=gen)
            others[i] = x[i]
            assert torch.equal(linear(others, weight, bias)[i], together[i]), (rows, i)
    big = linear(x, weight, bias)  # above SMALL_ROWS: the library's own kernel
    assert torch.allclose(big, F.linear(x, weight, bias))


def test_width_is_measured_once_per_shape() -> None:
    weight = torch.randn(67, 29)  # a shape no model in the suite has
    plan = calibrate(weight)
    assert len(plan) == SMALL_ROWS and all(sum(blocks) >= rows for rows, blocks in enumerate(plan, 1))
    assert calibrate(weight) == plan
    assert sum(1 for key in small_matmul._PLANS if key == ((67, 29), torch.float32, torch.get_num_threads())) == 1


def test_best_splits_minimise_total_time() -> None:
    # the down projection's measured shape: three rows in one block of three, four in one of four
    plan = best_splits({1: 1.9, 2: 1.9, 3: 2.2, 4: 3.4}, 8)
    assert plan[0] in ((1,), (2,)) and plan[2] == (3,) and plan[3] == (4,)
    assert sorted(plan[4]) == [2, 3] and sum(plan[7]) >= 8
    assert best_splits({4: 1.0}, 5) == ((4,), (4,), (4,), (4,), (4, 4))
