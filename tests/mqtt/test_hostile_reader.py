"""A fleet user in no job reads everything the shipped ACL lets it read while a fan-out
job runs, and learns nothing of the gradients (issue 27, item 5).

The ACL cannot name a job's members, so `mallory` may read every job's broadcasts
(`jobs/+/all/+`, where a fan-out job's members publish every compressed gradient),
the retained public manifest and presence. Every frame of a keyed job is sealed:
what mallory captured decodes with no key, opens only under the job key (read back
from the coordinator's checkpoint, the control that these are the gradient frames),
holds no 12 bytes running of any plaintext it opens to, and is ~8 bits a byte.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedring.coordinator.checkpoint import Checkpoint
from fedring.transport.mosquitto import Mosquitto
from fedring.wire.compact import decode_compact
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import decode_frame
from tests.mqtt.conftest import MISSING, Fleet, coordinator, finish, job_toml
from tests.mqtt.test_security import ACL, USERS

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

AGENTS = ("a1", "a2", "a3", "a4")


class Reader:
    """`mallory`: subscribes to everything and keeps what the broker delivers."""

    def __init__(self, port: int) -> None:
        self.got: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._subbed = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="mallory")
        self.c.username_pw_set("mallory", USERS["mallory"])
        self.c.on_message = self._on_message
        self.c.on_subscribe = lambda *_: self._subbed.set()
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        # Mosquitto grants a 3.1.1 subscription and applies the ACL to each delivery.
        self.c.subscribe([("fedring/v1/#", 1), ("fedring/v1/jobs/+/all/+", 1)])
        assert self._subbed.wait(5)

    def _on_message(self, _c: object, _u: object, m: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.got.append((m.topic, bytes(m.payload)))

    def captured(self) -> list[tuple[str, bytes]]:
        with self._lock:
            return list(self.got)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(users=USERS, acl=ACL, workdir=tmp_path_factory.mktemp("acl")) as b:
        yield b


def _entropy_bits(data: bytes) -> float:
    counts = Counter(data)
    return -sum(c / len(data) * math.log2(c / len(data)) for c in counts.values())


def _windows(data: bytes, size: int = 12) -> set[bytes]:
    return {data[i : i + size] for i in range(len(data) - size + 1)}


def _open(ck: Checkpoint, topic: str, data: bytes) -> bytes:
    """The body of a captured broadcast: refused without the key, opened with it (each
    epoch of the job has its own channel name)."""
    src = topic.rsplit("/", 1)[1]
    for epoch in range(ck.epoch + 1):
        where = {"job": f"{ck.job}.e{epoch}", "src": src, "dsts": ("*",)}
        try:
            decode_compact(data, key=None, **where)  # type: ignore[arg-type]
        except FrameError as exc:
            if exc.reason is FrameReason.UNEXPECTED:
                continue  # another epoch's
            assert exc.reason is FrameReason.BAD_MAC, exc
            return decode_compact(data, key=ck.key, **where).body  # type: ignore[arg-type]
        raise AssertionError(f"a frame on {topic} decodes without the key")
    raise AssertionError(f"a frame on {topic} is of no epoch of {ck.job}")


def test_a_user_in_no_job_learns_nothing_of_a_fan_out_jobs_gradients(
    secured: Mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDRING_MQTT_PASSWORD", USERS["coordinator"])  # the coordinator's
    fleet = Fleet(
        secured.url, tmp_path / "logs",
        extra={a: ["--username", a] for a in AGENTS},
        env={a: {"FEDRING_MQTT_PASSWORD": USERS[a]} for a in AGENTS},
    )  # fmt: skip
    reader = Reader(secured.port)
    try:
        for agent in AGENTS:
            fleet.start(agent)
        job = job_toml(tmp_path, collective="fanout", rounds=20, compression="group-topk",
                       density=0.01)  # fmt: skip
        summary = finish(coordinator(secured.url, job, tmp_path / "run", user="coordinator"))
    finally:
        reader.close()
        fleet.stop()
    assert summary["rounds"] == 20 and summary["identical_models"]
    ck = Checkpoint.load(tmp_path / "run")
    captured = reader.captured()
    broadcasts = [(t, d) for t, d in captured if t.startswith(f"fedring/v1/jobs/{ck.job}/all/")]
    # 4 members x 20 rounds, one payload each (more frames once split)
    assert len(broadcasts) >= 4 * 20, Counter(t.rsplit("/", 1)[0] for t, _ in captured)
    others = [(t, d) for t, d in captured if (t, d) not in broadcasts and d]
    assert all(t.startswith(("fedring/v1/agents/", f"fedring/v1/jobs/{ck.job}/manifest"))
               for t, _ in others), sorted({t for t, _ in others})  # fmt: skip

    plain = [_open(ck, topic, data) for topic, data in broadcasts]
    for topic, data in others:  # the public manifest: sealed as well
        if topic.endswith("/manifest"):
            with pytest.raises(FrameError):
                decode_frame(data, None)
            assert b"members" not in data and decode_frame(data, ck.key).kind == "manifest"

    seen = set().union(*(_windows(d) for _, d in broadcasts))
    leaked = [p for p in plain if _windows(p) & seen]
    assert not leaked, f"{len(leaked)} of {len(plain)} gradient bodies show on the wire"
    sealed = b"".join(d[-len(p) - 16 : -16] for (_, d), p in zip(broadcasts, plain, strict=True))
    assert len(sealed) > 50_000, len(sealed)
    assert _entropy_bits(sealed) > 7.99, _entropy_bits(sealed)  # noise: 8 less ~0.003 at 50 kB
    assert _entropy_bits(b"".join(plain)) < 7.8  # the control: the gradients are not (7.57)
