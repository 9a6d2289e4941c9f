"""A flood on a finished job's topics, by a broker user with a password, under the
shipped ACL (issue 27): the next job on the same daemons must finish as if nothing
had happened: no lost frame, no timeout, no re-formation.

Agents once subscribed to every job's broadcasts and never forgot a job they had
been in: 12,000 small frames on an old job's broadcast topic filled every idle
agent's queue to its limit, and the next job lost a round-0 frame, waited out a
timeout and re-formed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedring.transport import topics
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import MISSING, Fleet, job_toml

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

ACL = Path(__file__).resolve().parents[2] / "examples" / "mosquitto.acl"
AGENTS = [f"f{i}" for i in range(4)]
USERS = {"coordinator": "pw-c", "mallory": "pw-m", **{a: f"pw-{a}" for a in AGENTS}}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(users=USERS, acl=ACL, workdir=tmp_path_factory.mktemp("flood")) as b:
        yield b


@pytest.fixture(scope="module")
def fleet(secured: Mosquitto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("flood-logs")
    f = Fleet(secured.url, logs, extra={a: ["--username", a] for a in AGENTS},
              env={a: {"FEDRING_MQTT_PASSWORD": USERS[a]} for a in AGENTS})  # fmt: skip
    for agent in AGENTS:
        f.start(agent)
    yield f
    f.stop()


def _run(url: str, job: Path, out: Path) -> dict:
    args = [sys.executable, "-m", "fedring", "coordinator", "run", str(job), "--broker", url,
            "--out", str(out), "--json", "--username", "coordinator", "--no-onnx"]  # fmt: skip
    env = {**os.environ, "FEDRING_MQTT_PASSWORD": USERS["coordinator"]}
    with open(out.parent / f"{out.name}.log", "wb") as err:
        done = subprocess.run(args, stdout=subprocess.PIPE, stderr=err, env=env, timeout=240)
    assert done.returncode == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]
    return json.loads(done.stdout)


def _flood(port: int, job: str) -> int:
    """Everything mallory may publish on `job`'s topics: its broadcast topic and every
    agent's inbox under its own sender level. Returns the messages the broker took."""
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="mallory")
    c.username_pw_set("mallory", USERS["mallory"])
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port)
    c.loop_start()
    sent = []
    try:
        for i in range(12_000):
            sent.append(c.publish(topics.broadcast(job, "mallory"), bytes(100), qos=1))
            if i % 3000 == 0:
                big = [c.publish(topics.broadcast(job, "mallory"), bytes(2**20), qos=1)
                       for _ in range(5)]  # fmt: skip
                sent += big
        for agent in AGENTS:
            sent += [c.publish(topics.inbox(job, agent, "mallory"), bytes(100), qos=1)
                     for _ in range(100)]  # fmt: skip
        for info in sent:
            info.wait_for_publish(60)
    finally:
        c.loop_stop()
        c.disconnect()
    return len(sent)


def test_a_flood_on_a_finished_jobs_topics_costs_the_next_job_nothing(
    secured: Mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    first = _run(secured.url, job_toml(tmp_path / "one", rounds=10, collective="fanout"),
                 tmp_path / "one" / "run")  # fmt: skip
    assert first["reformations"] == 0
    assert _flood(secured.port, first["job"]) == 12_000 + 20 + 400
    second = _run(secured.url, job_toml(tmp_path / "two", rounds=20, collective="fanout"),
                  tmp_path / "two" / "run")  # fmt: skip
    assert second["reformations"] == 0, second["events"]
    for agent, counters in second["agent_counters"].items():
        assert counters.get("inbox_full", 0) == 0, (agent, counters)
    assert all(code == 0 for code in fleet.stop().values())
