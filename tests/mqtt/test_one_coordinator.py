"""One job, one coordinator: a second coordinator process is refused, clearly and at once.

Every coordinator connects under the one id ``coordinator``; two at a broker would
take the MQTT session from each other every few seconds for as long as both live
(issue 27: 4 minutes, both writing one output folder, nobody noticed). Here two
real coordinator processes meet over Mosquitto; no agent is needed (the first one
waits in enrolment).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import coordinator, job_toml, wait_for


@pytest.fixture()
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with Mosquitto(workdir=tmp_path / "broker") as b:
        yield b


def _log(out: Path) -> str:
    path = out.parent / f"{out.name}-coordinator.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _waiting(out: Path) -> bool:
    return "waiting for 4 agents" in _log(out)


def _retained(broker: Mosquitto, topic: str) -> list[bytes]:
    """What the broker retains on `topic` (read by a fresh subscriber)."""
    got: list[bytes] = []
    spy = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"spy-{time.monotonic_ns()}")
    spy.on_message = lambda _c, _u, m: got.append(bytes(m.payload)) if m.retain else None
    spy.connect("127.0.0.1", broker.port)
    spy.subscribe(topic, qos=0)
    spy.loop_start()
    time.sleep(0.3)  # a retained message arrives right after the subscription
    spy.loop_stop()
    spy.disconnect()
    return got


def _state(broker: Mosquitto) -> str:
    """The coordinator's presence as the broker retains it ("" if none)."""
    got = _retained(broker, "fedring/v1/agents/coordinator/status")
    return str(json.loads(got[-1]).get("state", "")) if got else ""


def _stopped(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        raise AssertionError(f"coordinator still running after {timeout} s") from None


def _first(broker: Mosquitto, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    job = job_toml(tmp_path, rounds=10)
    out = tmp_path / "first"
    proc = coordinator(broker.url, job, out, "--enrol-timeout", "60", *extra)
    wait_for(lambda: _waiting(out), 30, "the first coordinator to wait for agents")
    return proc, job


def test_a_second_coordinator_on_the_same_folder_is_refused(
    broker: Mosquitto, tmp_path: Path
) -> None:
    first, job = _first(broker, tmp_path)
    try:
        second = coordinator(broker.url, job, tmp_path / "first", "--enrol-timeout", "8")
        code = _stopped(second, 20)
        text = " ".join(_log(tmp_path / "first").split())  # rich wraps long lines
        assert code == 1
        assert f"{tmp_path / 'first'}" in text and f"pid {first.pid}" in text, text
        assert first.poll() is None  # the holder goes on, undisturbed
        assert "lost the broker" not in text
    finally:
        first.kill()
        first.wait(5)


def test_a_second_coordinator_at_the_same_broker_is_refused(
    broker: Mosquitto, tmp_path: Path
) -> None:
    first, job = _first(broker, tmp_path)
    try:
        started = time.monotonic()
        other = tmp_path / "second"
        second = coordinator(broker.url, job, other, "--enrol-timeout", "8")
        code = _stopped(second, 20)
        text = " ".join(_log(other).split())
        assert code == 1 and time.monotonic() - started < 8, text
        assert "a coordinator is already online at" in text, text
        assert "lost the broker" not in _log(tmp_path / "first")  # never kicked off
        assert first.poll() is None
    finally:
        first.kill()
        first.wait(5)


def test_a_stale_coordinator_that_wakes_up_stops_instead_of_fighting(
    broker: Mosquitto, tmp_path: Path
) -> None:
    """SIGSTOP the first until the broker takes it for lost, start another, SIGCONT the
    first: its reconnect finds the id held by a live session, and it stops."""
    first, job = _first(broker, tmp_path, "--keepalive", "2")
    second: subprocess.Popen[bytes] | None = None
    try:
        first.send_signal(signal.SIGSTOP)
        wait_for(lambda: _state(broker) == "lost", 30, "the broker to take the first for lost")
        other = tmp_path / "second"
        second = coordinator(broker.url, job, other, "--enrol-timeout", "60")
        wait_for(lambda: _waiting(other), 30, "the second coordinator to wait for agents")
        first.send_signal(signal.SIGCONT)
        code = _stopped(first, 20)
        text = " ".join(_log(tmp_path / "first").split())
        assert code == 1 and "stepped back" in text, text
        time.sleep(4)  # the second one reconnects once and stays
        assert second.poll() is None, _log(other)
        assert _log(other).count("lost the broker") <= 1, _log(other)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(5)


def test_a_starting_coordinator_clears_the_manifests_a_crashed_one_left(
    broker: Mosquitto, tmp_path: Path
) -> None:
    """A coordinator that crashed left its job's retained manifest ("running") for ever;
    only one coordinator is ever online at a broker, so the next one to start clears
    whatever manifest is retained (its own job's, resumed, is published again)."""
    topic = "fedring/v1/jobs/digits-dead0001/manifest"
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="crashed-coordinator")
    pub.connect("127.0.0.1", broker.port)
    pub.loop_start()
    pub.publish(topic, b"a manifest frame", qos=1, retain=True).wait_for_publish(5)
    pub.loop_stop()
    pub.disconnect()
    assert _retained(broker, topic) == [b"a manifest frame"]
    proc = coordinator(broker.url, job_toml(tmp_path), tmp_path / "run", "--enrol-timeout", "2")
    assert _stopped(proc, 30) == 1  # no agent: it gives up, after clearing
    assert _retained(broker, topic) == []


def test_at_a_broker_with_users_the_second_coordinator_steps_back(tmp_path: Path) -> None:
    """As deployed (users, client id = user name), nobody may look at the broker before
    connecting: the second coordinator connects, finds the id held, puts the holder's
    presence back and stops; the first reconnects and goes on."""
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    login = ("--password-file", str(secret))
    with Mosquitto(users={"coordinator": "s3cret"}, workdir=tmp_path / "broker") as b:
        job = job_toml(tmp_path, rounds=10)
        out = tmp_path / "first"
        first = coordinator(b.url, job, out, "--enrol-timeout", "60", *login, user="coordinator")
        try:
            wait_for(lambda: _waiting(out), 30, "the first coordinator to wait for agents")
            other = tmp_path / "second"
            second = coordinator(b.url, job, other, "--enrol-timeout", "60", *login,
                                 user="coordinator")  # fmt: skip
            code = _stopped(second, 30)
            text = " ".join(_log(other).split())
            assert code == 1 and "stepped back" in text, text
            time.sleep(4)  # the first reconnects and stays
            assert first.poll() is None, _log(out)
            # Once, or twice: CI under load once saw the first taken over again 0.6 s
            # after its reconnect, before the second stepped back (likely: the second
            # read the broker's will for the first, "lost", not its "online", so it
            # held on until the first's reconnect). Never more: the second has stopped.
            assert _log(out).count("lost the broker") <= 2, _log(out)
        finally:
            first.kill()
            first.wait(5)
