"""The Verifier replica's class without Serve: its compute thread reads the round channel and runs on the CPUs the
plan gives it (cluster/serving/cpu_binding.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from specserve_types.faults import FAULTS
from specserve_types.round_channel import ChannelServer
from specserve_types.round_channel_client import ChannelClient
from specserve_types.round_messages import VerifyBatch
from verifier_service.deployment import Verifier

MASK = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(MASK) < 2, reason="needs 2 CPUs in the affinity mask")
def test_the_compute_thread_runs_on_its_cpus_and_answers_the_channel_itself(smollm2_dir: Path) -> None:
    verifier = Verifier("smollm2-135m", 16, 16, worker_threads=1, dtype="float32", rank_cpus=[[MASK[-1]]])
    server = ChannelServer(verifier.channel_handlers(), "node", "127.0.0.1", "verifier",
                           reader=verifier.channel_reader())
    try:
        assert verifier.channel_reader() is verifier.compute
        assert verifier.compute.call(os.sched_getaffinity, 0) == {MASK[-1]}
        client = ChannelClient(server.start(), "node")
        result = client.call("verify", VerifyBatch(items=[]))
        assert result.outputs == [] and result.worker_instance == verifier.worker.instance
        # an injected latency delays the answer, not the compute thread that reads the connection
        FAULTS.inject("verifier.latency", times=1, seconds=0.3)
        start = time.monotonic()
        late = client.send("verify", VerifyBatch(items=[]))
        assert verifier.compute.call(lambda: 7) == 7 and time.monotonic() - start < 0.3
        assert late.result().outputs == [] and time.monotonic() - start >= 0.3
        client.close()
    finally:
        FAULTS.clear()
        server.close()
        verifier.compute.close()
