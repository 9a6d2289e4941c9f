"""The attack harness over a real Mosquitto: one daemon started with ``--attack``.

`fedring agent --attack sign-flip` is a test fixture for robust aggregation: the
daemon says so loudly when it starts and poisons every update it sends in every job
it joins, counted as ``attack_updates`` in the counters its ``bye`` reports. The
coordinator runs the star job to its end as with honest agents.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.engine.attack import Attack
from fedring.sim.runner import simulate
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import Fleet, coordinator, finish, job_toml

ROUNDS = 6


@pytest.fixture(scope="module")
def attacked(broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Four daemons; a3 attacks."""
    f = Fleet(broker.url, tmp_path_factory.mktemp("logs"), extra={"a3": ["--attack", "sign-flip"]})
    for i in range(4):
        f.start(f"a{i}")
    yield f
    f.stop()


def test_a_star_job_with_a_sign_flipping_daemon_completes_and_counts_it(
    broker: Mosquitto, attacked: Fleet, tmp_path: Path
) -> None:
    job = job_toml(tmp_path, topology="star", aggregation="mean", rounds=ROUNDS, eval_every=ROUNDS)
    summary = finish(coordinator(broker.url, job, tmp_path / "run"), timeout=120)
    assert summary["rounds"] == summary["centre_rounds"] == ROUNDS
    assert summary["identical_models"]
    counters = summary["agent_counters"]
    assert counters["a3"].get("attack_updates") == ROUNDS, json.dumps(counters)
    assert not any("attack_updates" in counters[a] for a in ("a0", "a1", "a2"))
    assert "this agent ATTACKS: sign-flip" in attacked.log("a3")
    assert "ATTACKS" not in attacked.log("a0")
    # The same poisoned job in one process, a3's rank attacking: the same model, bit for bit.
    rank = summary["members"].index("a3")
    local = simulate(JobSpec.from_toml(job), attack=Attack.parse("sign-flip"), attackers=[rank])
    assert summary["model_hashes"] == local["model_hashes"]
    assert local["attack"]["attackers"] == [rank]
