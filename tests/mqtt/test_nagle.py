"""A broker without `set_tcp_nodelay true`: reported with the fix, and made harmless
for our own links (issue 30).

Real Mosquitto brokers on loopback, one with the option and one without; the check's
numbers (41-55 ms an exchange against 0.2-8 ms) are in `fedring.transport.mqtt`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator

import pytest

import fedring
from fedring.counters import Counters
from fedring.transport.base import Deadline, Delivery
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import NAGLE_STALL_S, BrokerConfig, MqttEndpoint, MqttLink
from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

KEY = b"shared secret"


@pytest.fixture(scope="module")
def nagle_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with Mosquitto(workdir=tmp_path_factory.mktemp("nagle"), nodelay=False) as broker:
        yield broker.url


@pytest.fixture(scope="module")
def nodelay_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with Mosquitto(workdir=tmp_path_factory.mktemp("nodelay")) as broker:
        yield broker.url


def nagle_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "Nagle" in r.getMessage()]  # fmt: skip


def test_connect_warns_of_a_nagle_broker_naming_the_fix(
    nagle_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    counters = Counters()
    with (
        caplog.at_level(logging.WARNING, logger="fedring.transport.mqtt"),
        fedring.connect(
            nagle_url, job="slow", agent_id="n-1", world=1, key=KEY, wait_s=10, counters=counters
        ) as group,
    ):
        assert group.link.broker_nagle is True
    [warning] = nagle_warnings(caplog)
    assert "set_tcp_nodelay true" in warning and "troubleshooting.md" in warning
    assert counters.get("broker_nagle") == 1


def test_connect_is_quiet_with_set_tcp_nodelay(
    nodelay_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    counters = Counters()
    with (
        caplog.at_level(logging.WARNING, logger="fedring.transport.mqtt"),
        fedring.connect(
            nodelay_url, job="fast", agent_id="f-1", world=1, key=KEY, wait_s=10, counters=counters
        ) as group,
    ):
        assert group.link.broker_nagle is False
    assert nagle_warnings(caplog) == []
    assert counters.get("broker_nagle") == 0


@pytest.mark.parametrize(("which", "expected"), [("nagle", 1.0), ("nodelay", 0.0)])
def test_the_probe_in_agents_hellos_carries_the_finding(
    which: str, expected: float, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(f"{which}_url")
    link = MqttLink(BrokerConfig.parse(url, heartbeat=False), f"probe-{which}").connect()
    try:
        started = time.monotonic()
        link.check_broker_nagle()
        took = time.monotonic() - started
        probe = link.probe_link(total=64 * 1024)  # the finding is not checked twice
    finally:
        link.close()
    assert took < 0.5  # measured: ~0.14 s with Nagle (three stalled exchanges), ~5 ms without
    assert probe["broker_nagle"] == expected
    assert probe["link_bps"] > 0
    assert link.counters.get("broker_nagle") == int(expected)


def frame(endpoint: MqttEndpoint, deadline: Deadline) -> Delivery:
    """The next frame, past presence events."""
    while not isinstance(item := endpoint.recv(deadline), Delivery):
        pass
    return item


def test_our_links_ack_at_once_so_a_nagle_broker_costs_them_no_stall(nagle_url: str) -> None:
    """The ring's pattern: each side publishes (the broker's PUBACK comes back) and
    then waits for the other's small frame, which a Nagle broker holds until the ACK
    of that PUBACK: ~45 ms an exchange with delayed ACKs (`mqtt_connection.quick_ack`
    removes it)."""
    cfg = BrokerConfig.parse(nagle_url, heartbeat=False)
    a = MqttLink(cfg, "pp-a", control_from=(), job="pp").connect()
    b = MqttLink(cfg, "pp-b", control_from=(), job="pp").connect()
    try:
        ea, eb = a.endpoint("pp"), b.endpoint("pp")
        deadline = Deadline.after(20.0)
        while "pp-b" not in a.peers() or "pp-a" not in b.peers():
            assert not deadline.expired
            time.sleep(0.02)
        took = []
        for _ in range(30):
            start = time.perf_counter()
            ea.send("pp-b", bytes(200), deadline)
            frame(eb, deadline)
            eb.send("pp-a", bytes(200), deadline)
            frame(ea, deadline)
            took.append(time.perf_counter() - start)
    finally:
        a.close()
        b.close()
    assert statistics.median(took) < NAGLE_STALL_S / 2, [f"{t * 1e3:.1f} ms" for t in took]
