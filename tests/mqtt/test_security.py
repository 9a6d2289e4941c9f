"""Passwords, the example ACL and client ids bound to user names on a real Mosquitto:
the broker enforces who may do what, and who may be whom."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from typer.testing import CliRunner

from fedring.cli import app
from fedring.transport.base import Deadline
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig, BrokerRefused, IdentityMismatch, MqttLink
from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ACL = EXAMPLES / "mosquitto.acl"
USERS = {"coordinator": "pw-c", "a1": "pw-1", "a2": "pw-2", "a3": "pw-3", "a4": "pw-4",
         "mallory": "pw-m"}  # fmt: skip


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(users=USERS, acl=ACL, workdir=tmp_path_factory.mktemp("acl")) as b:
        yield b


class Raw:
    """A bare paho client, to see the broker's answers (SUBACK codes, deliveries)."""

    def __init__(self, port: int, user: str, client_id: str = "") -> None:
        self.got: list[str] = []
        self.suback: list[int] = []
        self._subbed = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"raw-{user}")
        self.c.username_pw_set(user, USERS[user])
        self.c.on_message = lambda _c, _u, m: self.got.append(m.topic)
        self.c.on_subscribe = self._on_subscribe
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def _on_subscribe(self, _c, _u, _mid, codes, _p) -> None:  # type: ignore[no-untyped-def]
        self.suback = [c.value for c in codes]
        self._subbed.set()

    def subscribe(self, topic: str) -> list[int]:
        self._subbed.clear()
        self.c.subscribe(topic, qos=1)
        assert self._subbed.wait(5)
        return self.suback

    def publish(self, topic: str) -> None:
        self.c.publish(topic, b"x", qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def _cfg(b: Mosquitto, user: str | None) -> BrokerConfig:
    return BrokerConfig.parse(
        b.url, username=user, password=USERS.get(user or ""), connect_timeout_s=5
    )


def test_anonymous_and_wrong_password_are_refused(secured: Mosquitto) -> None:
    with pytest.raises(BrokerRefused, match="anonymously"):
        MqttLink(_cfg(secured, None), "a9").connect()
    bad = BrokerConfig.parse(secured.url, username="a1", password="wrong", connect_timeout_s=5)
    with pytest.raises(BrokerRefused, match="'a1'"):
        MqttLink(bad, "a1").connect()


def test_agent_reads_only_its_inbox_and_cannot_pose_as_the_coordinator(
    secured: Mosquitto,
) -> None:
    a1, a2 = Raw(secured.port, "a1"), Raw(secured.port, "a2")
    coord = Raw(secured.port, "coordinator")
    try:
        assert a2.subscribe("fedring/v1/jobs/+/to/a2/+") == [1]  # its own inbox
        assert coord.subscribe("fedring/v1/#") == [1]
        # Mosquitto grants a 3.1.1 subscription and enforces the ACL on delivery.
        a1.subscribe("fedring/v1/jobs/+/to/a2/+")
        coord.publish("fedring/v1/jobs/j/to/a2/coordinator")
        a1.publish("fedring/v1/jobs/j/to/a2/a1")  # allowed: its own sender level
        a1.publish("fedring/v1/jobs/j/to/a2/coordinator")  # posing as the coordinator
        a1.publish("fedring/v1/jobs/j/manifest")  # the coordinator's manifest
        a1.publish("fedring/v1/agents/a2/status")  # another agent's presence
        deadline = Deadline.after(5)
        while "fedring/v1/jobs/j/to/a2/a1" not in a2.got and not deadline.expired:
            threading.Event().wait(0.05)
        threading.Event().wait(0.5)  # give any wrongly allowed message time to arrive
        assert a2.got == ["fedring/v1/jobs/j/to/a2/coordinator", "fedring/v1/jobs/j/to/a2/a1"]
        assert a1.got == []  # nothing from a2's inbox reached a1
        assert "fedring/v1/jobs/j/manifest" not in coord.got
        assert "fedring/v1/agents/a2/status" not in coord.got
        assert "fedring/v1/jobs/j/to/a2/a1" in coord.got  # the coordinator sees allowed traffic
    finally:
        for c in (a1, a2, coord):
            c.close()


def test_a_broadcast_under_a_forged_sender_level_is_denied(secured: Mosquitto) -> None:
    a1, a2, a3 = Raw(secured.port, "a1"), Raw(secured.port, "a2"), Raw(secured.port, "a3")
    try:
        assert a2.subscribe("fedring/v1/jobs/+/all/+") == [1]  # members read the job's
        a1.publish("fedring/v1/jobs/j/all/a3")  # posing as a3
        a1.publish("fedring/v1/jobs/j/all/coordinator")  # posing as the coordinator
        a1.publish("fedring/v1/jobs/j/all/a1")  # allowed: its own sender level
        deadline = Deadline.after(5)
        while "fedring/v1/jobs/j/all/a1" not in a2.got and not deadline.expired:
            threading.Event().wait(0.05)
        threading.Event().wait(0.5)  # give any wrongly allowed message time to arrive
        assert a2.got == ["fedring/v1/jobs/j/all/a1"]
    finally:
        for c in (a1, a2, a3):
            c.close()


def test_fedring_links_broadcast_under_the_acl(secured: Mosquitto) -> None:
    links = [MqttLink(_cfg(secured, u), u).connect() for u in ("a1", "a2", "a3")]
    try:
        inboxes = [link.endpoint("j") for link in links]
        time.sleep(0.3)  # the subscriptions settle
        inboxes[0].broadcast(b"to-all", Deadline.after(5))
        for inbox in inboxes[1:]:
            got = inbox.recv(Deadline.after(5))
            while not hasattr(got, "data"):
                got = inbox.recv(Deadline.after(5))
            assert got.src == "a1" and got.data == b"to-all"  # type: ignore[union-attr]
        time.sleep(0.3)
        assert links[0].counters.get("broadcast_echo") == 1  # 3.1.1: our own copy, dropped
        assert inboxes[0].stats.frames_received == 0
        assert links[0].stats.bytes_sent >= len(b"to-all") and inboxes[0].stats.frames_sent == 1
    finally:
        for link in links:
            link.close()


def test_fedring_links_work_under_the_acl(secured: Mosquitto) -> None:
    a1 = MqttLink(_cfg(secured, "a1"), "a1").connect()
    a2 = MqttLink(_cfg(secured, "a2"), "a2").connect()
    try:
        inbox = a2.endpoint("j")  # a link holds frames only of jobs it is in
        deadline = Deadline.after(5)
        while "a2" not in a1.peers() and not deadline.expired:
            threading.Event().wait(0.05)
        a1.endpoint("j").send("a2", b"frame", Deadline.after(5))
        got = inbox.recv(Deadline.after(5))
        while not hasattr(got, "data"):
            got = inbox.recv(Deadline.after(5))
        assert got.src == "a1" and got.data == b"frame"  # type: ignore[union-attr]
        assert a1.probe_bandwidth() > 0  # its own probe topic is allowed
    finally:
        a1.close()
        a2.close()


def test_the_example_config_binds_client_ids_to_user_names() -> None:
    settings = [line.split("#")[0].split() for line in (EXAMPLES / "mosquitto.conf").open()]
    assert ["use_username_as_clientid", "true"] in settings  # what `secured` runs with


def _session_present(port: int, client_id: str, username: str) -> bool:
    """Whether the broker still holds a persistent session for `client_id`."""
    flags: list[bool] = []
    spy = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
    spy.username_pw_set(username, USERS[username])
    spy.on_connect = lambda _c, _u, f, _rc, _p: flags.append(bool(f.session_present))
    spy.connect("127.0.0.1", port)
    spy.loop_start()
    deadline = Deadline.after(5)
    while not flags and not deadline.expired:
        time.sleep(0.02)
    spy.loop_stop()
    spy.disconnect()  # leaves a session again: callers ask once
    assert flags, "no CONNACK"
    return flags[0]


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_a_clean_goodbye_leaves_no_session_at_the_broker(secured: Mosquitto, protocol) -> None:  # type: ignore[no-untyped-def]
    """A session left behind queues every status message its subscriptions match until
    the broker's expiry; a crashed link's is left to `persistent_client_expiration`."""
    MqttLink(dataclasses.replace(_cfg(secured, "a3"), protocol=protocol), "a3").connect().close()
    assert not _session_present(secured.port, "fedring-a3", "a3")
    killed = MqttLink(_cfg(secured, "a4"), "a4").connect()
    killed.kill()
    time.sleep(0.5)
    assert _session_present(secured.port, "fedring-a4", "a4")  # the check can see one


def test_no_user_can_take_over_an_agents_client_id(secured: Mosquitto) -> None:
    a2 = MqttLink(_cfg(secured, "a2"), "a2").connect()
    thieves = []
    try:
        for client_id in ("fedring-a2", "a2"):  # the link's id, and its user name
            thieves.append(Raw(secured.port, "mallory", client_id=client_id))
            time.sleep(0.5)
        assert thieves[-1].subscribe("fedring/v1/agents/+/status") == [1]  # mallory is on
        assert a2.wait_connected(Deadline.after(0.1))
        assert a2.counters.get("mqtt_disconnect") == 0
    finally:
        for thief in thieves:
            thief.close()
        a2.close()


def test_an_id_that_is_not_the_user_name_is_refused() -> None:
    cfg = BrokerConfig.parse("mqtt://127.0.0.1:1", username="a1", password="pw-1")
    with pytest.raises(IdentityMismatch, match=r"'a5'.*'a1'"):
        MqttLink(cfg, "a5")
    args = ["agent", "--broker", "mqtt://127.0.0.1:1", "--id", "a5", "--username", "a1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "'a5'" in result.output and "'a1'" in result.output
