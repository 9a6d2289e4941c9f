"""`fedring bench mqtt` against a real Mosquitto: the broker's bytes beside ours."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")


def test_bench_mqtt_puts_broker_bytes_beside_frame_accounting() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fedring", "bench", "mqtt", "--agents", "2", "--rounds", "12",
         "--checkpoint-every", "4", "--json"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    dense, sparse = result["rows"]
    assert (dense["compression"], sparse["compression"]) == ("none", "group-topk")
    for row in (dense, sparse):
        assert row["identical_models"]
        assert row["rounds"] == 12
        # The broker receives every payload fedring published, plus MQTT's headers,
        # topic names and acknowledgements: never less.
        assert row["broker_received_per_round"] >= row["published_bytes_per_round"] > 0
        assert row["mqtt_overhead"] < 0.5
        # Everything an agent published includes its ring frames.
        for b in row["agent_bytes"].values():
            assert b["link"] >= b["ring"] > 0
    assert sparse["ring_bytes_per_agent_per_round"] < dense["ring_bytes_per_agent_per_round"] / 3
    assert result["broker_bytes_ratio"] > 1.5
