"""The checkpoint stream over a real Mosquitto: the head costs what a member costs.

Members other than the head send the coordinator patches of their slice of the model
(`edge_agent.checkpoint_stream`), the coordinator patches its copy
(`coordinator.replica`); the head uploads the whole model only at a segment's first
checkpoint or when the coordinator's copy disagrees. The checkpoint, the model
hashes and a resumed coordinator's end are what they were with dense uploads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.coordinator.checkpoint import Checkpoint
from fedring.sim.runner import simulate
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import Fleet, coordinator, finish, job_toml, started, wait_for


def _simulated(job: Path) -> str:
    [digest] = simulate(JobSpec.from_toml(job))["model_hashes"]
    return digest


def test_the_head_sends_within_a_quarter_of_a_member_and_the_hash_is_unchanged(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    job = job_toml(tmp_path, rounds=60, checkpoint_every=1, compression="group-topk",
                   density=0.01)  # fmt: skip
    summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    assert summary["model_hashes"] == [_simulated(job)]
    assert Checkpoint.load(tmp_path / "run").params_sha256 == summary["model_hashes"][0]
    assert summary["checkpoint_round"] == 60
    assert "checkpoint_patch_refused" not in summary["coordinator_counters"]
    sent = summary["agent_bytes"]
    head, *others = summary["members"]
    for member in others:  # every byte each one published: ring, checkpoint, control
        assert sent[head]["link"] <= 1.25 * sent[member]["link"], sent
        assert sent[member]["checkpoint"] > 0
        assert sum(sent[member][k] for k in ("ring", "checkpoint", "control")) == (
            sent[member]["link"]
        )
    # the head's one whole model (the segment's first checkpoint), not one a round
    numel = Checkpoint.load(tmp_path / "run").params.numel()  # type: ignore[union-attr]
    assert 4 * numel < sent[head]["checkpoint"] < 2 * 4 * numel
    assert summary["bytes_sent_per_agent"] == sum(b["link"] for b in sent.values()) / 4


def test_a_resumed_coordinator_patches_on_and_lands_on_the_same_hash(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    job = job_toml(tmp_path, rounds=60, checkpoint_every=1)
    out = tmp_path / "run"
    proc = started(broker.url, job, out, 20)
    proc.kill()
    proc.wait(10)
    summary = finish(coordinator(broker.url, job, out, "--resume"))
    assert summary["rounds"] == 60 and summary["identical_models"]
    assert summary["model_hashes"] == [_simulated(job)]
    assert Checkpoint.load(out).params_sha256 == summary["model_hashes"][0]
    assert "checkpoint_patch_refused" not in summary["coordinator_counters"]


@pytest.fixture
def drifting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mosquitto, Fleet]]:
    """Three daemons on their own broker; d2 nudges its parameters before every round
    (`FEDRING_INJECT_DRIFT`) but says it is the same machine: a member that disagrees."""
    with Mosquitto(workdir=tmp_path_factory.mktemp("drift-broker")) as b:
        f = Fleet(b.url, tmp_path_factory.mktemp("logs"),
                  env={"d2": {"FEDRING_INJECT_DRIFT": "1e-6"}})  # fmt: skip
        for i in range(3):
            f.start(f"d{i}")
        try:
            yield b, f
        finally:
            f.stop()


def test_a_copy_that_disagrees_takes_the_heads_whole_model(
    drifting: tuple[Mosquitto, Fleet], tmp_path: Path
) -> None:
    broker, fleet = drifting
    wait_for(lambda: all("ready" in fleet.log(a) for a in ("d0", "d1", "d2")), 30, "daemons")
    job = job_toml(tmp_path, agents=3, rounds=20, checkpoint_every=1)
    summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    assert summary["rounds"] == 20
    # d2's patches claim another hash: the coordinator asked the head for its model
    assert summary["coordinator_counters"].get("checkpoint_patch_refused", 0) >= 1
    ck = Checkpoint.load(tmp_path / "run")
    assert ck.round == 20 and ck.params_sha256 in summary["model_hashes"]
