"""A board whose uplink is busy with its own send is slow, not lost (issue 29).

A beat cannot overtake the bytes queued before it on the board's connection. In the lab,
a fan-out at 1 Mbit/s had every member publish ~0.7 MB at once: their beats reached the
coordinator ~6 s late, past 1.25 keep-alives, every member was taken for lost in round
0 and the job failed ("no agent holding a shard is online"). Here a real Mosquitto, and
an uplink held to ~260 kB/s by a `DelayProxy` that holds 64 KiB for 250 ms.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from fedring.lab.delay import DelayProxy
from fedring.transport import topics
from fedring.transport.base import Deadline
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig, MqttLink
from tests.mqtt.conftest import MISSING, wait_for

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

KEEPALIVE = 3  # the board's: its watcher's silence limit is 1.25 x 3 = 3.75 s
SEND_BYTES = 2_500_000  # ~5.5 s through the proxy (its probe says less): longer than
# that limit, and than paho's own (no answer to its ping a keep-alive later)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(workdir=tmp_path_factory.mktemp("slow-uplink")) as b:
        yield b


def _send_long(board: MqttLink) -> None:
    """One long message on `board`'s uplink; returns once the broker has it."""
    topic = topics.inbox("job-x", "nobody", board.me)
    board.publish(topic, bytes(SEND_BYTES), Deadline.after(30))
    wait_for(lambda: board._conn.unacked_bytes() == 0, 30, "the broker's ack")


def test_a_board_busy_sending_on_a_slow_uplink_is_not_taken_for_lost(broker: Mosquitto) -> None:
    proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", broker.port), delay_ms=250,
                       max_buffer=64 * 1024)  # fmt: skip
    watcher = MqttLink(BrokerConfig.parse(broker.url, keepalive=4), "w", watch=True).connect()
    with proxy:
        host, port = proxy.address
        cfg = BrokerConfig.parse(f"mqtt://{host}:{port}", keepalive=KEEPALIVE)
        board = MqttLink(cfg, "slow").connect()
        try:
            up_bps = board.probe_link()["up_bps"]  # as an agent's, before its hello
            assert 80e3 < up_bps < 800e3, up_bps  # the proxy's ~260 kB/s
            wait_for(lambda: "slow" in watcher.peers(), 10, "the board online")

            # Measured (as every agent's is, before its hello), a beat ahead of the
            # send says how long the next ones may take, and the send goes in parts
            # whose acks come back within a keep-alive: slow, neither lost nor dropped.
            _send_long(board)
            time.sleep(1.0)  # its next beat is through
            assert board.counters.get("mqtt_parts_sent") >= 5
            assert board.counters.get("mqtt_disconnect") == 0
            assert watcher.counters.get("peer_silent") == 0
            assert "slow" in watcher.peers() and watcher.silent_peers() == set()
        finally:
            board.close()
            watcher.close()
