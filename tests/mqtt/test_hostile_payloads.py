"""Every entry point a broker user can reach, fuzzed without a broker (issue 27).

A hostile payload goes through `MqttLink._route`, as paho's thread would hand it
over, and then through what reads each queue in a real process: the coordinator's
hello and control handling (`Coordinator._on_hello`, `_on_item`, the `Fleet` figures
drawn from hellos), the pipeline coordinator's boards, and the `PeerChannel`s of an
agent and of the coordinator's centre. Nothing may raise; every payload that is bad
by construction (too deep, too big, not JSON, not msgpack, unsigned) must be counted
as a refusal. `_route` is called directly, not `_on_message`, whose catch-all
would hide a crash as a counter.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fedring.collective.channel import PeerChannel
from fedring.config import JobSpec
from fedring.coordinator.checkpoint import Checkpoint
from fedring.coordinator.pipeline_fleet import StageFleet
from fedring.coordinator.service import Coordinator, Options, _Epoch
from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import Deadline, Delivery, TransportTimeout
from fedring.transport.mqtt import BrokerConfig, MqttLink
from fedring.wire.control import ControlCodec
from fedring.wire.frame import KINDS, Frame, encode_frame

KEY = b"k" * 32
JOB = "digits-0a1b2c3d"
MEMBERS = ["a0", "a1"]
CFG = BrokerConfig("127.0.0.1", 1)  # never connected: `_route` is fed by hand
# Counters a refusal shows in (the link's, the codecs', the channels'); any rise counts.
REFUSALS = ("frame_", "bad_status", "bad_beat", "inbox_other_job", "duplicate")

# -- payloads -------------------------------------------------------------------------------

FIELDS = ["profile", "step_s", "link_bps", "rtt_s", "up_bps", "down_bps", "encode_s",
          "decode_s", "machine", "threads", "epoch", "round", "why", "sha256", "committed",
          "resynced", "drift_max_abs", "drift_l2", "numel", "accuracy", "state", "session",
          "job", "keepalive", "max_frame_bytes", "ram_budget_mb", "gflops", "name"]  # fmt: skip
ODD_VALUES = [10**400, -(10**4000), 2**64, float("inf"), float("nan"), "\ud800", "x" * 300,
              [[[[[[[[1]]]]]]]], {"round": {"round": []}}, True, None, [1, 2, 3], {}]  # fmt: skip


def _deep(depth: int, opening: bytes, closed: bool) -> bytes:
    closing = b"]" if opening == b"[" else b"}"
    return opening * depth + (b"0" + closing * depth if closed else b"")


deep_json = st.builds(_deep, st.integers(40, 6000), st.sampled_from([b"[", b'{"a":', b"{"]),
                      st.booleans())  # fmt: skip
oversized = st.sampled_from([300 * 1024, 2 * 2**20]).map(lambda n: b'{"a":"' + b"x" * n + b'"}')
garbage = st.binary(max_size=2048).map(lambda b: b"\x00" + b)  # NUL: neither JSON nor a map
not_an_object = st.sampled_from([b"[]", b"3", b'"hello"', b"null", b"[1, {}]"])
# well-formed objects whose fields have the wrong type, or figures beyond any float
odd_value = st.sampled_from(ODD_VALUES) | st.integers(-(2**70), 2**70) | st.floats()
odd_object = st.dictionaries(st.sampled_from(FIELDS), odd_value, min_size=1, max_size=6)
bad_documents = deep_json | oversized | garbage | not_an_object
deep_msgpack = st.integers(100, 6000).map(lambda n: b"\x81\xa1a" * n + b"\xc0")  # {"a": {...}}


_SEQ = itertools.count(1)


@dataclass(frozen=True)
class Case:
    payload: bytes
    refused: bool  # bad by construction: must be counted wherever it is read


def _control(kind: str, src: str, doc: bytes, key: bytes | None) -> bytes:
    """A control frame around `doc` as it is (`ControlCodec.encode` writes only JSON)."""
    frame = Frame(kind=kind, job=JOB, src=src, dst=topics.COORDINATOR, seq=next(_SEQ), round=1,
                  meta={"doc": len(doc)}, body=doc)  # fmt: skip
    return encode_frame(frame, key)


@st.composite
def cases(draw: st.DrawFn, src: str) -> Case:
    """What `src` might publish: raw bad bytes, or control frames around bad documents
    (unsigned: refused; signed with the job key by a member: odd fields get through)."""
    which = draw(st.sampled_from(["raw", "msgpack", "control", "signed", "compact"]))
    if which == "raw":
        return Case(draw(bad_documents), True)
    if which == "msgpack":
        return Case(draw(deep_msgpack), True)
    if which == "compact":  # a compact ring frame's version byte, then garbage
        return Case(b"\x02" + draw(st.binary(max_size=512)), True)
    kind = draw(st.sampled_from(sorted(KINDS)))
    if draw(st.booleans()):  # a document that no reader may take
        doc = draw(bad_documents)
        return Case(_control(kind, src, doc, KEY if which == "signed" else None), True)
    odd = draw(odd_object)
    if which == "signed":  # as a member holding the job key would send it
        frames = ControlCodec(src, key=KEY).encode(kind, JOB, topics.COORDINATOR, odd)
        return Case(frames[0], False)
    # only a hello is read unsigned (and the coordinator's own manifest)
    return Case(_control(kind, src, json.dumps(odd).encode(), None), kind != "hello")


# -- the receivers ------------------------------------------------------------------------


class CoordinatorSide:
    """The coordinator's link, mid-job, with what reads its queues."""

    def __init__(self, out: Path) -> None:
        self.counters = Counters()
        self.coord = Coordinator(JobSpec(agents=2), CFG, Options(out=out))
        self.coord.counters = self.counters
        self.coord.codec.counters = self.counters
        self.coord.codec.key = KEY
        self.link = MqttLink(CFG, topics.COORDINATOR, control_from=("*",), listen_hellos=True,
                             watch=True, counters=self.counters)  # fmt: skip
        self.coord.link = self.link
        self.coord.ck = Checkpoint(job=JOB, key=KEY, spec={}, shards={a: i for i, a in
                                   enumerate(MEMBERS)}, model_sha256="", shard_manifest={},
                                   epoch=0, round=0, params=None)  # fmt: skip
        self.ep = _Epoch(0, list(MEMBERS), 0)
        self.pipeline = StageFleet(CFG, self.counters)
        self.channels = [self._channel(topics.star(JOB), private=True), self._channel(JOB)]

    def _channel(self, job: str, private: bool = False) -> PeerChannel:
        return PeerChannel(self.link.endpoint(job, private=private), job, KEY,
                           counters=self.counters)  # fmt: skip

    def drain(self) -> None:
        while True:
            try:
                item = self.link.control.get_nowait()
            except queue.Empty:
                break
            self.pipeline.link.control.put(item)
            if item.kind == "hello":
                self.coord._on_hello(item)
            else:
                self.coord._on_item(self.ep, item)
            self.pipeline.next(0.0)
        for channel in self.channels:
            _drain_channel(channel)
        fleet, everyone = self.coord.fleet, sorted(self.coord.fleet.hellos)
        fleet.order(set(everyone))
        fleet.frame_bytes(everyone)
        fleet.stall(everyone, 20.0)
        fleet.probes(everyone)
        fleet.mixed(everyone)
        fleet.round_estimate(everyone)
        for agent in self.pipeline.hellos:
            self.pipeline.board(agent)


def _drain_channel(channel: PeerChannel) -> None:
    """What `PeerChannel._pull` does with each delivery, without a wait."""
    while True:
        try:
            item = channel.endpoint.recv(Deadline.after(0.0))
        except TransportTimeout:
            return
        if isinstance(item, Delivery):
            channel._take(item.src, item.data)


class AgentSide:
    """Agent a1's link in the job, and its ring and star channels."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.link = MqttLink(CFG, "a1", counters=self.counters)
        self.channels = [
            PeerChannel(self.link.endpoint(JOB), JOB, KEY, counters=self.counters),
            PeerChannel(self.link.endpoint(topics.star(JOB), private=True), topics.star(JOB),
                        KEY, counters=self.counters),
        ]  # fmt: skip

    def drain(self) -> None:
        assert self.link.control.empty(), "a broker user reached the agent's control queue"
        for channel in self.channels:
            _drain_channel(channel)


def _refusals(*counters: Counters) -> int:
    return sum(n for c in counters for k, n in c.snapshot().items() if k.startswith(REFUSALS))


# -- the property -------------------------------------------------------------------------

ROOT = topics.ROOT
COORDINATOR_TOPICS = {  # entry point -> (topic, the sender the broker vouches for)
    "hello": (topics.hello("mallory"), "mallory"),
    "inbox": (topics.inbox(JOB, topics.COORDINATOR, "mallory"), "mallory"),
    "member inbox": (topics.inbox(JOB, topics.COORDINATOR, "a1"), "a1"),
    "star inbox": (topics.inbox(topics.star(JOB), topics.COORDINATOR, "mallory"), "mallory"),
    "metrics": (topics.metrics(JOB, "mallory"), "mallory"),
    "member metrics": (topics.metrics(JOB, "a0"), "a0"),
    "broadcast": (topics.broadcast(JOB, "mallory"), "mallory"),
}
AGENT_TOPICS = {
    "agent inbox": (topics.inbox(JOB, "a1", "mallory"), "mallory"),
    "agent star inbox": (topics.inbox(topics.star(JOB), "a1", "mallory"), "mallory"),
    "agent broadcast": (topics.broadcast(JOB, "mallory"), "mallory"),
}


@pytest.mark.slow
@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_payload_on_any_entry_point_raises_and_every_bad_one_is_counted(
    data: st.DataObject, tmp_path: Path
) -> None:
    coordinator, agent = CoordinatorSide(tmp_path), AgentSide()
    for side, entry_points in ((coordinator, COORDINATOR_TOPICS), (agent, AGENT_TOPICS)):
        for name, (topic, src) in entry_points.items():
            case = data.draw(cases(src), label=name)
            before = _refusals(side.counters)
            side.link._route(topic, case.payload, data.draw(st.booleans(), label="retained"))
            side.drain()
            if case.refused:
                assert _refusals(side.counters) > before, f"{name}: {case.payload[:80]!r}"
                if name == "hello":  # a refused hello never makes mallory a candidate
                    assert "mallory" not in coordinator.coord.fleet.hellos


# a status fits in 1,024 bytes: nesting just short of that, and odd fields in a good one
deep_status = st.integers(990, 1024).map(lambda n: b"[" * n)
odd_status = st.fixed_dictionaries(
    {"state": st.sampled_from(["online", "lost", "offline"]), "session": st.text(max_size=8)},
    optional={"keepalive": odd_value, "job": odd_value},
).map(lambda d: json.dumps(d).encode())


@settings(max_examples=100)
@given(
    payload=bad_documents | deep_status | odd_status | st.binary(max_size=1100),
    retained=st.booleans(),
)
@example(payload=b'{"state": "online", "session": "s", "keepalive": 1' + b"0" * 400 + b"}",
         retained=False)  # fmt: skip
def test_presence_and_beats_never_raise(payload: bytes, retained: bool) -> None:
    side = CoordinatorSide(Path("/nonexistent"))
    for leaf in ("status", "beat", "probe"):
        side.link._route(f"{ROOT}/agents/mallory/{leaf}", payload, retained)
    side.drain()
    online = "mallory" in side.link.peers()
    status: dict[str, Any] | None = None
    with contextlib.suppress(ValueError, RecursionError):
        status = json.loads(payload) if len(payload) <= 1024 else None
    if online:  # only a readable status that says so puts it online
        assert isinstance(status, dict) and status.get("state") == "online"
    elif payload and len(payload) <= 1024 and not isinstance(status, dict):
        assert side.counters.get("bad_status") == 1


def test_a_deeply_nested_hello_is_refused_and_counted() -> None:
    """The crash of issue 27, on its own: a retained hello 5000 deep."""
    side = CoordinatorSide(Path("/nonexistent"))
    side.link._route(topics.hello("mallory"), _control("hello", "mallory", b"[" * 5000, None), True)
    side.drain()
    assert side.counters.get("frame_too_deep") >= 1 and not side.coord.fleet.hellos


def test_a_deeply_nested_status_is_refused_and_counted() -> None:
    """Outside hypothesis (which raises the recursion limit while it runs a test), 1,000
    brackets were enough for `json.loads` to raise RecursionError out of `_route`."""
    side = CoordinatorSide(Path("/nonexistent"))
    side.link._route(f"{ROOT}/agents/mallory/status", b"[" * 1020, True)
    assert side.counters.get("bad_status") == 1 and "mallory" not in side.link.peers()
