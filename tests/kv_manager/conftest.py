"""Fixtures of the kv_manager tests; every ledger a test gets is leak-checked when the test ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_manager import BlockLedger, Holder
from tests.kv_manager.kv_helpers import end_of_test_check, make_ledger


@pytest.fixture
def ledger() -> Iterator[BlockLedger]:
    ledger = make_ledger()
    yield ledger
    end_of_test_check(ledger)


@pytest.fixture
def holder(ledger: BlockLedger) -> Holder:
    return ledger.register_worker("verifier-0")
