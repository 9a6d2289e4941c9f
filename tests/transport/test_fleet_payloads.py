"""What `fedring fleet` reads from the network, without a broker: beats (`parse_beat`,
`Presence.beat`), statuses and hellos (`fleet.BoardTable`), hostile ones included.

Time is the caller's (``now``), so no test waits out a keep-alive.
"""

from __future__ import annotations

import json
import threading

from hypothesis import given
from hypothesis import strategies as st

from fedring.counters import Counters
from fedring.fleet import MAX_BOARDS, MAX_TEXT, BoardTable, read_hello
from fedring.transport import topics
from fedring.transport.base import MembershipEvent
from fedring.transport.mqtt_broker import BrokerConfig
from fedring.transport.mqtt_presence import (
    MAX_BEAT_BYTES,
    SILENT_AFTER,
    Beat,
    Presence,
    parse_beat,
)
from fedring.wire.control import ControlCodec


def hello(who: str, **fields: object) -> bytes:
    doc = {"id": who, "session": "s1", "machine": "aarch64", "fedring": "0.1.0",
           "torch": "2.13.0", "threads": 4, "rss": 100 << 20, "mem_total": 4 << 30,
           "started": 1.7e9, "job": "", "profile": {"profile": "rpi4", "link": "wifi"},
           **fields}  # fmt: skip
    [frame] = ControlCodec(who).encode("hello", "-", topics.COORDINATOR, doc, sign=False)
    return frame


def status(state: str, session: str = "s1", keepalive: float = 4, **extra: object) -> bytes:
    return json.dumps({"state": state, "session": session, "keepalive": keepalive,
                       **extra}).encode()  # fmt: skip


def table() -> BoardTable:
    t = BoardTable(Counters())
    t.listening(0.0)
    return t


# -- beats ------------------------------------------------------------------------------


def test_a_beat_of_every_age_reads_and_unknown_fields_are_skipped_quietly() -> None:
    assert parse_beat(b"s1") == Beat("s1")  # the first beats had no keep-alive
    assert parse_beat(b"s1 5") == Beat("s1")
    assert parse_beat(b"s1 5 rss=1048576") == Beat("s1", rss=1048576)
    assert parse_beat(b"s1 5 rss=7 temp=41 fan=on") == Beat("s1", rss=7)  # a newer agent


def test_a_malformed_beat_field_is_named_and_the_session_still_read() -> None:
    for payload, why in [
        (b"s1 5 rss=-1", "rss=-1"),
        (b"s1 5 rss=1e9", "rss=1e9"),
        (b"s1 5 rss=", "'rss='"),
        ("s1 5 rss=²".encode(), "not ASCII"),
        (b"s1 5 rss=" + b"9" * 40, "not a whole number"),  # beyond 2**48
        (b"s1 5 rss", "not KEY=VALUE"),
        (b"s1 5 " + b"a=1 " * 9, "fields > 8"),
        (b"s1 5 rss=1 " + b"x" * MAX_BEAT_BYTES, f"> {MAX_BEAT_BYTES}"),
    ]:
        beat = parse_beat(payload)
        assert beat.session == "s1" and beat.rss is None, payload
        assert why in beat.bad, (payload, beat.bad)


@given(st.binary(max_size=400))
def test_any_beat_parses_and_its_session_is_what_it_always_was(payload: bytes) -> None:
    beat = parse_beat(payload)
    assert beat.session == payload[:64].decode("ascii", "replace").partition(" ")[0]
    assert beat.rss is None or 0 <= beat.rss <= 2**48


def test_presence_counts_a_bad_beat_field_and_still_takes_the_beat() -> None:
    seen: list[tuple[str, str]] = []

    def emit(who: str, events: list[MembershipEvent]) -> None:
        seen.extend((e.kind, who) for e in events)

    up, counters = threading.Event(), Counters()
    up.set()
    cfg = BrokerConfig("127.0.0.1", 1883, keepalive=4)
    presence = Presence(cfg, "coordinator", counters, emit, up)
    presence.status("a1", status("online"), retained=False)
    presence.beat("a1", b"s1 4 rss=oops")
    presence.beat("a1", b"s1 4 rss=5 " + b"z" * 400)
    assert counters.get("bad_beat_field") == 2 and counters.get("bad_beat") == 0
    assert "a1" in presence.peers() and seen == [("joined", "a1")]


# -- the board table ----------------------------------------------------------------------


def test_a_board_reads_whole_from_its_hello_status_and_beats() -> None:
    t = table()
    t.hello("a1", hello("a1", job="digits-1"), 0.0)
    t.status("a1", status("online"), 0.0)
    t.beat("a1", b"s1 4 rss=209715200", 1.0)
    [b] = t.boards(1.5)
    assert (b.id, b.state, b.profile, b.link, b.arch, b.fedring, b.torch, b.job) == (
        "a1", "online", "rpi4", "wifi", "aarch64", "0.1.0", "2.13.0", "digits-1")  # fmt: skip
    assert (b.rss_bytes, b.mem_total_bytes, b.threads, b.started) == (200 << 20, 4 << 30, 4, 1.7e9)
    assert b.last_beat_s == 0.5 and b.keepalive_s == 4 and not b.notes
    assert not t.counters.snapshot()


def test_a_silent_board_is_lost_after_its_limit_and_back_when_it_beats() -> None:
    t = table()
    t.status("a1", status("online"), 0.0)
    t.beat("a1", b"s1 4", 0.1)
    limit = SILENT_AFTER * 4
    assert t.boards(0.1 + limit - 0.01)[0].state == "online"
    [b] = t.boards(0.1 + limit + 0.01)
    assert b.state == "lost" and "no beat for" in b.why
    t.beat("a1", b"s1 4", 6.0)
    assert t.boards(6.1)[0].state == "online"


def test_a_board_whose_beat_says_it_is_busy_sending_is_online_that_much_longer() -> None:
    """As the coordinator's watch: its next beats wait behind its sends (issue 29)."""
    t = table()
    t.status("a1", status("online"), 0.0)
    t.beat("a1", b"s1 4 rss=1 busy=10.0", 0.1)
    limit = SILENT_AFTER * 4 + 10.0
    assert t.boards(0.1 + limit - 0.01)[0].state == "online"
    assert t.boards(0.1 + limit + 0.01)[0].state == "lost"
    t.beat("a1", b"s1 4", 20.0)  # through: the plain limit again
    assert t.boards(20.0 + SILENT_AFTER * 4 + 0.01)[0].state == "lost"


def test_a_board_that_never_beat_is_lost_once_another_ones_beats_are_heard() -> None:
    t = table()
    t.status("hung", status("online", "h"), 0.0)
    t.status("a1", status("online"), 0.0)
    assert not t.decided(1.0)
    assert {b.id: b.state for b in t.boards(6.0)} == {"hung": "online", "a1": "online"}
    assert t.warnings(6.0) and "may this user read" in t.warnings(6.0)[0]  # no beats at all
    t.beat("a1", b"s1 4", 5.9)
    assert {b.id: b.state for b in t.boards(6.0)} == {"hung": "lost", "a1": "online"}
    assert t.decided(6.0) and not any("heartbeat" in w for w in t.warnings(6.0))


def test_wills_goodbyes_and_our_own_outage() -> None:
    t = table()
    t.status("a1", status("lost"), 0.0)
    t.status("a2", status("offline"), 0.0)
    t.status("a3", status("online", "s3"), 0.0)
    t.beat("a3", b"s3 4", 0.0)
    t.status(topics.COORDINATOR, status("online", "c"), 0.0)
    t.paused()  # our link is down: silence is ours, not theirs
    assert {b.id: b.state for b in t.boards(100.0)} == {"a1": "lost", "a2": "offline",
                                                       "a3": "online"}  # fmt: skip
    coordinator = t.coordinator(100.0)
    assert coordinator is not None and coordinator.state == "online"
    t.listening(100.0)  # back: the clock starts again
    assert t.boards(101.0)[2].state == "online" and t.boards(106.0)[2].state == "lost"


def test_a_beat_of_another_session_does_not_keep_a_board_alive() -> None:
    t = table()
    t.status("a1", status("online", "s1"), 0.0)
    t.beat("a1", b"s1 4", 0.0)
    t.beat("a1", b"forged 4 rss=1", 5.0)
    t.beat("a1", b"", 5.0)
    assert t.counters.get("bad_beat") == 2
    [b] = t.boards(5.5)
    assert b.state == "lost" and b.rss_bytes is None


def test_hostile_hellos_are_counted_and_noted_never_raised() -> None:
    t = table()
    t.status("a1", status("online"), 0.0)
    t.hello("a1", b"\x00" * 100, 0.0)  # not a frame
    t.hello("a1", b"x" * (1 << 17), 0.0)  # oversized
    [metrics] = ControlCodec("a1").encode("metrics", "-", topics.COORDINATOR, {}, sign=False)
    t.hello("a1", metrics, 0.0)
    [b] = t.boards(0.0)
    assert t.counters.get("bad_hello") == 3 and len(b.notes) == 3
    assert "bytes >" in b.notes[1] and "not a hello" in b.notes[2]
    t.hello("a1", hello("a1", profile=[1], torch=3, rss=-5, threads="x",
                        started="soon", machine="\x1b[2J" + "x" * 500), 0.0)  # fmt: skip
    [b] = t.boards(0.0)
    assert t.counters.get("bad_hello_field") == 5, b.notes
    assert b.arch == "[2J" + "x" * (MAX_TEXT - 3) and b.torch == "" and b.rss_bytes is None
    assert b.profile == "" and b.started is None and b.threads is None


def test_hostile_statuses_and_too_many_boards() -> None:
    t = table()
    t.status("a1", b"[" * 5000, 0.0)
    t.status("a2", b"x" * 5000, 0.0)
    t.status("a3", status("zombie\x07"), 0.0)
    assert t.counters.get("bad_status") == 3
    rows = {b.id: b for b in t.boards(0.0)}
    assert rows["a3"].state == "unknown" and rows["a3"].why == "status says 'zombie'"
    assert rows["a1"].state == "unknown" and rows["a1"].notes
    for i in range(MAX_BOARDS):
        t.beat(f"b{i}", b"s 4", 0.0)
    assert len(t.boards(0.0)) == MAX_BOARDS and t.counters.get("too_many_boards") == 3


@given(st.sampled_from(["hello", "status", "beat"]), st.binary(max_size=2000))
def test_any_payload_on_any_topic_never_raises(leaf: str, payload: bytes) -> None:
    t = table()
    getattr(t, leaf)("a1", payload, 0.0)
    for b in t.boards(10.0):
        json.dumps(b.as_dict())
    assert read_hello("a1", payload)[2] is not None
