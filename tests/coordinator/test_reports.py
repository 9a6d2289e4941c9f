"""A re-formed ring takes its members from the coordinator's own liveness, not from a
member's report (issue 27: a survivor reported a killed peer before the coordinator's
watch did, and the ring re-formed twice with the dead agent in it, stalling 17 s).

The coordinator runs here without a broker: a stand-in link whose presence the test
sets, and control items fed in the order that went wrong (report, then watch).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fedring.config import JobSpec
from fedring.coordinator.service import Coordinator, CoordinatorError, Options, _Epoch
from fedring.transport import topics
from fedring.transport.base import MembershipEvent
from fedring.transport.mqtt import BrokerConfig, Control
from fedring.wire.control import ControlCodec

AGENTS = ["a0", "a1", "a2", "a3"]
JOB, KEY = "digits-0001", b"k" * 32
KEEPALIVE = 2  # the verdict comes within SILENT_AFTER x this, plus a margin


class StandInLink:
    """What the coordinator reads of its `MqttLink`: presence and the control queue."""

    def __init__(self) -> None:
        self.online = set(AGENTS)
        self.silent: set[str] = set()  # taken for lost by their beats, not gone
        self.control: queue.Queue[Control] = queue.Queue()
        self.taken_over = ""

    def peers(self) -> frozenset[str]:
        return frozenset(self.online)

    def silent_peers(self) -> frozenset[str]:
        return frozenset(self.silent)


def _coordinator(tmp_path: Path) -> tuple[Coordinator, StandInLink]:
    spec = JobSpec.from_mapping({"agents": 4, "dataset": "digits"})
    cfg = BrokerConfig.parse("mqtt://127.0.0.1:1", keepalive=KEEPALIVE)
    c = Coordinator(spec, cfg, Options(out=tmp_path))
    link = StandInLink()
    c.link = link  # type: ignore[assignment]
    c.ck = SimpleNamespace(shards={a: i for i, a in enumerate(AGENTS)}, job=JOB,  # type: ignore[assignment]
                           round=5)  # fmt: skip
    c.codec.key = KEY
    c.fleet.hellos = {a: {} for a in AGENTS}
    return c, link


def _nack(src: str, why: str) -> Control:
    codec = ControlCodec(src, key=KEY)
    doc: dict[str, Any] = {"epoch": 0, "committed": 5, "sha256": "", "why": why}
    [frame] = codec.encode("nack", JOB, topics.COORDINATOR, doc)
    return Control("frame", src, frame, JOB)


def _reported(c: Coordinator) -> None:
    """a1's ring channel saw a2 go before the coordinator's own watch did."""
    why, _ = c._on_item(_Epoch(0, list(AGENTS), 5), _nack("a1", "peer 'a2' left or was lost"))
    assert why == "a1 stopped: peer 'a2' left or was lost"


def test_a_peer_reported_lost_is_not_a_member_before_the_watch_agrees(tmp_path: Path) -> None:
    c, link = _coordinator(tmp_path)
    _reported(c)
    watch = threading.Timer(0.5, link.online.discard, ("a2",))  # the watch's verdict, later
    watch.start()
    started = time.monotonic()
    members = c._members()
    watch.join()
    assert "a2" not in members and sorted(members) == ["a0", "a1", "a3"]
    assert time.monotonic() - started < 3  # the verdict, not a fixed wait


def test_a_reported_peer_that_beats_on_is_a_member_after_the_verdict(tmp_path: Path) -> None:
    """A wrong report (a1's own hiccup): the link still sees a2 beating once a silence
    would have been noticed, so a2 stays in the ring."""
    c, _link = _coordinator(tmp_path)
    _reported(c)
    started = time.monotonic()
    members = c._members()
    assert sorted(members) == AGENTS
    assert 1.25 * KEEPALIVE <= time.monotonic() - started < 1.25 * KEEPALIVE + 3


def test_a_reported_peer_back_under_a_new_session_is_a_member_at_once(tmp_path: Path) -> None:
    c, link = _coordinator(tmp_path)
    _reported(c)
    link.control.put(Control("member", "a2", event=MembershipEvent("lost", "a2")))
    link.control.put(Control("member", "a2", event=MembershipEvent("joined", "a2")))
    started = time.monotonic()
    assert sorted(c._members()) == AGENTS
    assert time.monotonic() - started < 1


def _all_silent(link: StandInLink) -> None:
    """Every member's beats stopped at once (a fan-out at 1 Mbit/s, each uplink busy
    with its own payload): all taken for lost, none gone."""
    link.silent, link.online = set(link.online), set()


def test_a_ring_of_members_all_silent_waits_for_one_to_beat_again(tmp_path: Path) -> None:
    """It failed at once: "no agent holding a shard is online" (issue 29)."""
    c, link = _coordinator(tmp_path)
    _all_silent(link)

    def back() -> None:
        link.silent -= {"a0", "a3"}
        link.online |= {"a0", "a3"}

    threading.Timer(0.5, back).start()
    started = time.monotonic()
    assert sorted(c._members()) == ["a0", "a3"]
    assert time.monotonic() - started < 3
    assert c.counters.get("ring_waited_for_silent") == 1


def test_a_ring_of_members_all_silent_gives_up_after_its_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("fedring.coordinator.port.SILENT_WAIT_S", 0.5)
    c, link = _coordinator(tmp_path)
    _all_silent(link)
    started = time.monotonic()
    assert c._members() == []
    assert 0.5 <= time.monotonic() - started < 2


def test_a_ring_with_no_silent_holder_does_not_wait(tmp_path: Path) -> None:
    c, link = _coordinator(tmp_path)
    link.online = set()  # every one left (goodbye or will)
    started = time.monotonic()
    assert c._members() == []
    assert time.monotonic() - started < 1 and c.counters.get("ring_waited_for_silent") == 0


@pytest.mark.parametrize("why", ["error: out of memory", "refused: no such task"])
def test_a_nack_that_names_no_peer_suspects_nobody(tmp_path: Path, why: str) -> None:
    c, _link = _coordinator(tmp_path)
    c._on_item(_Epoch(0, list(AGENTS), 5), _nack("a1", why))
    started = time.monotonic()
    assert "a2" in c._members()
    assert time.monotonic() - started < 1


def test_every_refusal_counts_in_the_fewer_agents_message(tmp_path: Path) -> None:
    """Two agents refuse the job: the first one's nack ends the epoch, the second one's
    arrives while the others halt; both count, and neither is in the next ring."""
    c, link = _coordinator(tmp_path)
    c.opts.halt_timeout_s = 1.0
    link.send_to = lambda *_args: None  # type: ignore[attr-defined]
    ep = _Epoch(0, list(AGENTS), 5)
    why, _ = c._on_item(ep, _nack("a3", "refused: module 'x' is not allowed on this agent"))
    link.control.put(_nack("a2", "refused: module 'x' is not allowed on this agent"))
    for agent in ("a0", "a1"):
        link.control.put(_nack(agent, "halted"))
    c._reform(ep, why)
    with pytest.raises(CoordinatorError) as refusal:
        c._check_refusals(c._members())
    text = str(refusal.value)
    assert "2 of the 4 agents the job needs are left after 2 refused it" in text, text
    assert "a2: refused" in text and "a3: refused" in text


@pytest.mark.parametrize("why", ["peer 'a2' left or was lost", "refused: no such task"])
def test_the_member_whose_nack_ended_the_epoch_is_not_awaited_at_the_halt(
    tmp_path: Path, why: str
) -> None:
    """Its segment ended with its nack: it answers no halt. The halt waited for it all of
    `halt_timeout_s` (10 s by default) at every re-formation a member's nack began
    (seen in the degrade test's log: epoch 1 began 10.0 s after epoch 0 ended)."""
    c, link = _coordinator(tmp_path)
    c.opts.halt_timeout_s = 30.0
    link.send_to = lambda *_args: None  # type: ignore[attr-defined]
    ep = _Epoch(0, list(AGENTS), 5)
    ended, _ = c._on_item(ep, _nack("a1", why))
    assert ended == f"a1 stopped: {why}"
    for agent in ("a0", "a2", "a3"):  # the others answer the halt
        link.control.put(_nack(agent, "halted"))
    started = time.monotonic()
    c._reform(ep, ended)
    assert time.monotonic() - started < 5  # not the 30 s of the halt's deadline
    assert ep.stopped == set(AGENTS) and set(ep.halted) == set(AGENTS)  # a1's round too


def test_a_sample_above_the_agents_enrolled_is_said_in_the_events(tmp_path: Path) -> None:
    """`sample = 3` of 4, started with --min-agents 2: every round trains both, and the
    summary's events say so (the job file itself may not ask for more than `agents`)."""
    spec = JobSpec.from_mapping({"agents": 4, "dataset": "digits", "topology": "star",
                                 "sample": 3.0})  # fmt: skip
    c = Coordinator(spec, BrokerConfig.parse("mqtt://127.0.0.1:1"),
                    Options(out=tmp_path, min_agents=2))  # fmt: skip
    link = StandInLink()
    link.online = {"a0", "a1"}
    c.link = link  # type: ignore[assignment]
    c.fleet.hellos = {a: {} for a in AGENTS}
    ck = c._enrol_and_plan()
    assert sorted(ck.shards) == ["a0", "a1"]
    [event] = c.events
    assert "sample=3 asks for more agents a round than the 2 enrolled" in event["why"]
