"""Messages over the broker's packet cap: cut by `split_message`, joined by `Joiner`,
and `Connection.publish` choosing between the two (no broker here; tests/brokers runs
them against Mosquitto's real ``max_packet_size``)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import Deadline, LinkStats
from fedring.transport.mqtt_broker import MIN_MAX_MESSAGE, BrokerConfig, MessageTooLarge
from fedring.transport.mqtt_connection import MIN_UPLINK_PART, Connection, Hooks
from fedring.transport.mqtt_parts import (
    HEADER,
    MAGIC,
    Joiner,
    PartError,
    is_part,
    packet_size,
    piece_bytes,
    split_message,
)

TOPIC = topics.inbox("job-1", "a2", "a1")


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 300_000), cap=st.integers(1024, 140_000), v5=st.booleans(),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_parts_fit_the_cap_and_join_in_any_order_with_repeats(
    size: int, cap: int, v5: bool, seed: int
) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(size)
    parts = split_message(TOPIC, data, cap, msg_id=7)
    assert all(packet_size(TOPIC, len(p), v5) <= cap and is_part(p) for p in parts)
    assert len(parts) == max(1, -(-size // piece_bytes(TOPIC, cap)))
    shuffled = parts + rng.sample(parts, k=min(3, len(parts)))  # QoS 1 repeats
    rng.shuffle(shuffled)
    joiner, whole = Joiner(), []
    for part in shuffled:
        got = joiner.add(TOPIC, part)
        if got is not None:
            whole.append(got)
    assert whole == [data] and joiner.pending == 0 and joiner.held_bytes == 0


def test_packet_size_counts_the_fixed_header_topic_packet_id_and_properties() -> None:
    # 1 type byte, a 1-byte remaining length, 2+5 topic, 2 packet id, (1 property length)
    assert packet_size("a/b/c", 10, v5=False) == 1 + 1 + 7 + 2 + 10
    assert packet_size("a/b/c", 10, v5=True) == 1 + 1 + 7 + 2 + 1 + 10
    assert packet_size("t", 200, v5=False) == 1 + 2 + 3 + 2 + 200  # 2-byte remaining length


def test_no_frame_or_presence_document_looks_like_a_part() -> None:
    from fedring.wire.frame import Frame, encode_frame

    frame = encode_frame(Frame("chunk", "job-1", "a1", "a2", seq=1, body=b"x" * 10))
    assert not is_part(frame) and not is_part(b'{"state": "online"}') and not is_part(b"")
    assert MAGIC[0] == 0xC1  # the byte msgpack never writes


def test_a_part_repeated_after_its_message_was_joined_is_dropped() -> None:
    parts = split_message(TOPIC, bytes(5000), 2048, msg_id=1)
    joiner = Joiner()
    assert [joiner.add(TOPIC, p) for p in parts][-1] == bytes(5000)
    assert joiner.add(TOPIC, parts[0]) is None and joiner.pending == 0


def test_the_same_message_id_from_another_sender_is_another_message() -> None:
    mine, theirs = topics.inbox("j", "a2", "a1"), topics.inbox("j", "a2", "a3")
    a = split_message(mine, b"a" * 5000, 2048, msg_id=1)
    b = split_message(theirs, b"b" * 5000, 2048, msg_id=1)
    joiner = Joiner()
    got = [
        joiner.add(t, p) for pa, pb in zip(a, b, strict=True) for t, p in ((mine, pa), (theirs, pb))
    ]
    assert [g for g in got if g is not None] == [b"a" * 5000, b"b" * 5000]


@pytest.mark.parametrize(
    ("part", "words"),
    [
        (MAGIC + b"\x00" * 4, "shorter than its header"),
        (HEADER.pack(MAGIC, 1, 3, 3) + b"x", "index below it"),
        (HEADER.pack(MAGIC, 1, 0, 0) + b"x", "count must be in"),
        (HEADER.pack(MAGIC, 1, 0, 10**6) + b"x", "count must be in"),
    ],
)
def test_a_malformed_part_is_refused_with_a_reason(part: bytes, words: str) -> None:
    with pytest.raises(PartError, match=words):
        Joiner().add(TOPIC, part)


def test_a_part_that_disagrees_with_its_siblings_drops_the_message() -> None:
    joiner = Joiner()
    assert joiner.add(TOPIC, HEADER.pack(MAGIC, 5, 0, 3) + b"x") is None
    with pytest.raises(PartError, match="says 4 parts, its siblings 3"):
        joiner.add(TOPIC, HEADER.pack(MAGIC, 5, 1, 4) + b"y")
    assert joiner.pending == 0 and joiner.held_bytes == 0


def test_incomplete_messages_are_bounded_in_number_and_bytes() -> None:
    joiner = Joiner(max_pending=4, max_bytes=10_000)
    for msg in range(10):  # first parts only: none completes
        joiner.add(TOPIC, HEADER.pack(MAGIC, msg, 0, 2) + bytes(100))
    assert joiner.pending == 4 and joiner.abandoned == 6
    joiner.add(TOPIC, HEADER.pack(MAGIC, 99, 0, 9) + bytes(9_990))  # the oldest make room
    assert joiner.held_bytes <= 10_000 and joiner.pending == 1 and joiner.abandoned == 10


# -- Connection.publish ---------------------------------------------------------------


class FakeClient:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, bool]] = []

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> object:
        assert qos == 1  # never QoS 2: AWS IoT Core refuses it
        self.published.append((topic, bytes(payload), retain))
        return type("Info", (), {"rc": 0, "is_published": lambda _self: True})()

    def socket(self) -> None:  # no socket to set TCP_QUICKACK on
        return None


def connection(url: str) -> tuple[Connection, FakeClient]:
    conn = Connection(BrokerConfig.parse(url), "a1", None, Counters(), LinkStats())
    conn.client = FakeClient()  # type: ignore[assignment]
    return conn, conn.client  # type: ignore[return-value]


def test_a_message_long_on_a_measured_uplink_leaves_in_parts_sent_within_a_keep_alive() -> None:
    """paho takes its link for dead when nothing answers its ping within a keep-alive,
    and the ping waits behind our send: 2.5 MB at ~260 kB/s dropped the link, and QoS
    1 sent it again on every reconnect (issue 29). Parts take half a keep-alive each."""
    conn, client = connection("mqtt://127.0.0.1:1883")  # keep-alive 5 s
    assert conn.cfg.keepalive == 5
    conn.publish(TOPIC, bytes(1_000_000), Deadline.after(1))
    assert len(client.published) == 1  # unmeasured: as the broker takes it
    conn.up_bps = 100_000.0  # 0.8 Mbit/s: 250 kB in half a keep-alive
    conn.publish(TOPIC, bytes(1_000_000), Deadline.after(1))
    sizes = [packet_size(t, len(p), v5=False) for t, p, _ in client.published[1:]]
    assert len(sizes) == 5 and max(sizes) <= conn.uplink_part() == 250_000
    conn.publish(TOPIC, bytes(1_000_000), Deadline.after(1), retain=True)
    assert len(client.published[-1][1]) == 1_000_000  # a retained message goes whole
    conn.up_bps = 1.0  # however slow: parts of MIN_UPLINK_PART
    assert conn.uplink_part() == MIN_UPLINK_PART


def test_the_smaller_of_the_brokers_and_the_uplinks_cap_cuts() -> None:
    conn, client = connection("mqtt://127.0.0.1:1883?max_message=128k")
    conn.up_bps = 1e6  # 2.5 MB in half a keep-alive: the broker's cap is smaller
    conn.publish(TOPIC, bytes(400_000), Deadline.after(1))
    assert max(packet_size(t, len(p), v5=False) for t, p, _ in client.published) <= 128 * 1024


def test_a_message_over_the_url_cap_leaves_in_parts_that_fit() -> None:
    conn, client = connection("mqtt://127.0.0.1:1883?max_message=128k")
    conn.publish(TOPIC, bytes(400_000), Deadline.after(1))
    conn.publish(TOPIC, bytes(1000), Deadline.after(1))
    sizes = [packet_size(t, len(p), v5=False) for t, p, _ in client.published]
    assert (
        len(sizes) == 5
        and max(sizes) <= 128 * 1024
        and sizes[-1] == packet_size(TOPIC, 1000, False)
    )
    assert conn.counters.get("mqtt_parts_sent") == 4 and conn.stats.frames_sent == 2


def test_the_connack_cap_holds_when_smaller_than_the_url_s() -> None:
    conn, client = connection("mqtt://127.0.0.1:1883?max_message=1m&protocol=5")
    props = Properties(PacketTypes.CONNACK)
    props.MaximumPacketSize = 100_000
    conn._read_connack(props)
    assert conn.max_message == 100_000
    conn.publish(TOPIC, bytes(250_000), Deadline.after(1))
    assert len(client.published) == 3
    assert all(packet_size(t, len(p), v5=True) <= 100_000 for t, p, _ in client.published)


def test_a_retained_message_over_the_cap_is_an_error_naming_the_cap() -> None:
    conn, client = connection("mqtt://127.0.0.1:1883?max_message=128k")
    with pytest.raises(MessageTooLarge, match="packet cap of 131072 bytes"):
        conn.publish(topics.hello("a1"), bytes(200_000), Deadline.after(1), retain=True)
    assert client.published == [] and conn.counters.get("mqtt_too_large") == 1


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("mqtt://h?max_message=64k", f"at least {MIN_MAX_MESSAGE} bytes"),
        ("mqtt://h?max_message=lots", "max_message='lots'"),
        ("mqtt://h?protocol=4", "protocol='4' must be one of"),
        ("mqtt://h?qos=2", "unknown option 'qos'"),
    ],
)
def test_a_bad_url_option_is_named(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        BrokerConfig.parse(url)


def test_url_options_are_parsed_and_keyword_options_win() -> None:
    cfg = BrokerConfig.parse("mqtts://h?max_message=131072&protocol=auto", protocol="5")
    assert (cfg.max_message_bytes, cfg.protocol, cfg.port, cfg.url) == (
        131072,
        "5",
        8883,
        "mqtts://h:8883",
    )


def test_the_receiving_link_joins_parts_and_refuses_a_retained_one() -> None:
    conn, _ = connection("mqtt://127.0.0.1:1883")
    got: list[tuple[str, bytes]] = []
    conn._hooks = Hooks(
        up=lambda *_: None, down=lambda: None, own_status=lambda *_: None,
        received=lambda topic, data, _retained: got.append((topic, data)),
    )  # fmt: skip

    def deliver(payload: bytes, retain: bool = False) -> None:
        msg = type("M", (), {"topic": TOPIC, "payload": payload, "retain": retain})()
        conn._on_message(FakeClient(), None, msg)  # type: ignore[arg-type]

    data = bytes(range(256)) * 1000
    parts = split_message(TOPIC, data, 100_000, msg_id=3)
    deliver(b"a whole frame")
    deliver(parts[0], retain=True)
    for part in parts:
        deliver(part)
    assert got == [(TOPIC, b"a whole frame"), (TOPIC, data)]
    assert conn.counters.get("mqtt_part_refused") == 1
