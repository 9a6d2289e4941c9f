"""A broker user who sends what no parser should meet, under the shipped ACL (issue 27).

Mallory has a password and nothing else: no job key. Before the coordinator starts
it leaves a hello 5,000 deep retained on its own hello topic (which once ended every
coordinator start until someone cleared it); once the job's manifest appears it
sends nested, oversized and garbage payloads on every topic the ACL lets it write:
its own hello, status, beat and probe, the coordinator's and each agent's inbox under
its own sender level, the job's broadcast and its own metrics. The coordinator and
the agent daemons must stay up, count what they refused, and finish the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedring.transport import topics
from fedring.transport.mosquitto import Mosquitto
from fedring.wire.frame import Frame, encode_frame
from tests.mqtt.conftest import MISSING, Fleet, job_toml

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

ACL = Path(__file__).resolve().parents[2] / "examples" / "mosquitto.acl"
AGENTS = ["h0", "h1"]
USERS = {"coordinator": "pw-c", "mallory": "pw-m", **{a: f"pw-{a}" for a in AGENTS}}
ROUNDS = 120


def _control(kind: str, job: str, dst: str, doc: bytes, seq: int) -> bytes:
    """An unsigned control frame from mallory around `doc` as it is."""
    frame = Frame(kind=kind, job=job, src="mallory", dst=dst, seq=seq, meta={"doc": len(doc)},
                  body=doc)  # fmt: skip
    return encode_frame(frame)


def _payloads(job: str, dst: str) -> list[bytes]:
    """Nested (5,000 deep, as JSON and as msgpack), oversized and garbage payloads, bare
    and inside control frames of the kinds a receiver reads before any key check."""
    deep = [b"[" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000]
    odd = json.dumps({"profile": [[[1]]], "step_s": "x", "link_bps": 10**30}).encode()
    huge = b'{"step_s": ' + b"9" * 400 + b"}"
    bare = [*deep, b"\x81\xa1a" * 5000 + b"\xc0", os.urandom(2 * 2**20), os.urandom(777),
            b"\x02" + os.urandom(300), b"", b"\xff" * 64]  # fmt: skip
    framed = [_control(kind, job, dst, doc, seq)
              for seq, (kind, doc) in enumerate(
                  [(k, d) for k in ("hello", "manifest", "metrics") for d in (*deep, odd, huge)]
                  + [("manifest", b"x" * 300 * 1024)], start=1)]  # fmt: skip
    return bare + framed


class Mallory:
    """A bare paho client under mallory's password."""

    def __init__(self, port: int) -> None:
        self.jobs: list[str] = []
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="mallory")
        self.c.username_pw_set("mallory", USERS["mallory"])
        self.c.on_message = self._on_message
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def _on_message(self, _c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        job = msg.topic.split("/")[3]
        if msg.payload and job not in self.jobs:
            self.jobs.append(job)

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        info = self.c.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(30)
        assert info.is_published(), topic

    def attack(self, job: str) -> int:
        """Every payload on every topic the ACL lets mallory write; returns how many."""
        sent = 0
        for leaf in ("hello", "status", "beat", "probe"):
            topic = f"{topics.ROOT}/agents/mallory/{leaf}"
            for payload in _payloads("-", topics.COORDINATOR):
                self.publish(topic, payload, retain=leaf in ("hello", "status") and sent % 2 == 0)
                sent += 1
        inboxes = [(topics.inbox(job, topics.COORDINATOR, "mallory"), topics.COORDINATOR),
                   (topics.inbox(topics.star(job), topics.COORDINATOR, "mallory"),
                    topics.COORDINATOR),
                   *[(topics.inbox(job, a, "mallory"), a) for a in AGENTS],
                   (topics.broadcast(job, "mallory"), "*"),
                   (topics.metrics(job, "mallory"), topics.COORDINATOR)]  # fmt: skip
        for topic, dst in inboxes:
            for payload in _payloads(job, dst):
                self.publish(topic, payload)
                sent += 1
        return sent

    def close(self) -> None:
        for leaf in ("hello", "status"):  # leave nothing retained for the next module
            self.publish(f"{topics.ROOT}/agents/mallory/{leaf}", b"", retain=True)
        self.c.loop_stop()
        self.c.disconnect()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(users=USERS, acl=ACL, workdir=tmp_path_factory.mktemp("hostile")) as b:
        yield b


def test_a_broker_user_cannot_end_the_coordinator_or_an_agent_with_one_message(
    secured: Mosquitto, tmp_path: Path
) -> None:
    mallory = Mallory(secured.port)
    fleet = Fleet(secured.url, tmp_path / "logs", extra={a: ["--username", a] for a in AGENTS},
                  env={a: {"FEDRING_MQTT_PASSWORD": USERS[a]} for a in AGENTS})  # fmt: skip
    coordinator: subprocess.Popen[bytes] | None = None
    try:
        # the retained hello that once ended every coordinator start, and a retained status
        deep_hello = _control("hello", "-", topics.COORDINATOR, b"[" * 5000, 1)
        mallory.publish(topics.hello("mallory"), deep_hello, retain=True)
        mallory.publish(topics.status("mallory"), b"[" * 1020, retain=True)
        mallory.c.subscribe(f"{topics.ROOT}/jobs/+/manifest", qos=1)  # the ACL lets all read it
        for agent in AGENTS:
            fleet.start(agent)
        job = job_toml(tmp_path / "job", agents=2, rounds=ROUNDS, collective="ring")
        out = tmp_path / "job" / "run"
        args = [sys.executable, "-m", "fedring", "-v", "coordinator", "run", str(job),
                "--broker", secured.url, "--out", str(out), "--json", "--username",
                "coordinator", "--enrol-timeout", "60", "--no-onnx"]  # fmt: skip
        err = open(tmp_path / "coordinator.log", "wb")  # noqa: SIM115 - owned by the process
        coordinator = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
            env={**os.environ, "FEDRING_MQTT_PASSWORD": USERS["coordinator"]},
        )  # fmt: skip
        err.close()
        deadline = time.monotonic() + 60
        while not mallory.jobs:
            assert coordinator.poll() is None, _tail(tmp_path / "coordinator.log")
            assert time.monotonic() < deadline, "no manifest within 60 s"
            time.sleep(0.05)
        result: dict[str, int] = {}
        attack = threading.Thread(
            target=lambda: result.update(sent=mallory.attack(mallory.jobs[0]))
        )
        attack.start()
        stdout, _ = coordinator.communicate(timeout=150)
        attack.join(30)
        log = _tail(tmp_path / "coordinator.log")
        assert coordinator.returncode == 0, log
        summary = json.loads(stdout)
        assert summary["rounds"] == ROUNDS and summary["identical_models"], summary
        refused = {k: v for k, v in summary["coordinator_counters"].items()
                   if k.startswith(("frame_", "bad_"))}  # fmt: skip
        assert refused.get("frame_too_deep", 0) >= 1, (refused, log)  # the retained hello
        assert refused.get("bad_beat", 0) >= 1, refused  # mid-job: beats are never retained
        for agent, counters in summary["agent_counters"].items():  # counted during the job
            assert any(k.startswith(("frame_", "bad_")) for k in counters), (agent, counters)
        assert result.get("sent", 0) > 100
        for agent, proc in fleet.procs.items():
            assert proc.poll() is None, f"{agent} ended:\n{fleet.log(agent)[-3000:]}"
    finally:
        if coordinator is not None and coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait(10)
        codes = fleet.stop()
        mallory.close()
    assert codes == {a: 0 for a in AGENTS}, codes


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""
