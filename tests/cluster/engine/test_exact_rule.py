"""The engine's exact rule (EngineConfig.exact_rule, ClusterConfig's `exact_rule`) on every verified chain: the
verifier applies block or token-by-token verification to sampled chains as the engine says
(tests/verifier_service/test_block_verification.py checks the rules themselves); nothing is leaked."""

from __future__ import annotations

import dataclasses

import pytest

from specserve_types.round_messages import VerifyBatch, VerifyItem
from tests.cluster.engine.engine_helpers import fake_engine, request, run


@pytest.mark.parametrize("rule", ["block", "token"])
def test_the_engines_exact_rule_reaches_every_verified_item(rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = fake_engine(exact_rule=rule)
    seen: list[VerifyItem] = []
    real = engine.verifier.verify

    def spy(batch: VerifyBatch, *args, **kwargs):
        seen.extend(batch.items)
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(engine.verifier, "verify", spy)
    outputs = run(engine, [request("sampled", [5, 6, 7], max_tokens=12, k=3, contract="exact", temperature=0.8,
                                   seed=3),
                           request("greedy", [8, 9], max_tokens=12, k=3)])
    assert len(outputs["sampled"]) == 12 and len(outputs["greedy"]) == 12
    assert any(item.draft_ids and item.request_id == "sampled" for item in seen), "the sampled request drafted"
    assert {item.exact_rule for item in seen} == {rule}


def test_the_rule_is_a_checked_setting_block_by_default() -> None:
    from cluster.serving.config import ConfigError, make_config

    assert make_config().exact_rule == "block" and make_config().engine_config().exact_rule == "block"
    assert make_config(exact_rule="token").engine_config().exact_rule == "token"
    with pytest.raises(ConfigError, match="exact_rule"):
        make_config(exact_rule="blocky")
    with pytest.raises(ValueError, match="exact_rule"):
        dataclasses.replace(make_config().engine_config(), exact_rule="blocky")
