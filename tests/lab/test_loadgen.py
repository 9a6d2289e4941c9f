"""The fleet-scale load generator: its MQTT packets, its frames as fedring reads them,
and small fleets of protocol agents against a real Mosquitto and a real coordinator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fedring.collective.channel import PeerChannel
from fedring.collective.payloads import decode_payload, encode_payload
from fedring.collective.ring import Ring
from fedring.collective.ring import chunk_bounds as ring_chunk_bounds
from fedring.compression.group_topk import GroupTopK
from fedring.compression.payload import PayloadLimits
from fedring.compression.sparse import SparseGroups
from fedring.coordinator.replica import Replica
from fedring.lab.loadgen import LoadSettings, ProtocolAgent, Segment
from fedring.lab.loadgen_mqtt import (
    MqttProtocolError,
    PacketReader,
    connect_packet,
    parse_publish,
    publish_packet,
    remaining_length,
)
from fedring.lab.loadgen_payloads import Params, chunk_bounds, star_payload
from fedring.lab.loadgen_report import fit, fits, table
from fedring.lab.loadgen_ring import RingPeer, RingShape
from fedring.training.models import flat_sha256
from fedring.transport.base import Deadline, Delivery, LinkStats, TransportTimeout
from fedring.transport.mosquitto import MosquittoMissing, mosquitto_binary
from fedring.wire.control import ControlCodec, ControlMessage
from fedring.wire.frame import FrameLimits

try:
    mosquitto_binary()
    MISSING = ""
except MosquittoMissing as exc:
    MISSING = str(exc)


# -- MQTT packets ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152])
def test_remaining_length_reads_back(n: int) -> None:
    packet = bytes([0x30]) + remaining_length(n) + b"x" * n
    [(first, body)] = PacketReader(max_bytes=1 << 22).feed(packet)
    assert first == 0x30 and len(body) == n


def test_packets_split_across_reads_come_out_whole() -> None:
    stream = publish_packet("a/b", b"hello", qos=1, packet_id=7) + publish_packet("c", b"", qos=0)
    reader, got = PacketReader(), []
    for i in range(len(stream)):  # one byte a read: the worst a socket can do
        got += reader.feed(stream[i : i + 1])
    msgs = [parse_publish(first, body) for first, body in got]
    assert [(m.topic, m.payload, m.qos, m.packet_id) for m in msgs] == [
        ("a/b", b"hello", 1, 7), ("c", b"", 0, 0)]  # fmt: skip


def test_oversized_and_malformed_packets_are_refused() -> None:
    with pytest.raises(MqttProtocolError, match="packet of 1000 bytes > 100"):
        PacketReader(max_bytes=100).feed(bytes([0x30]) + remaining_length(1000))
    with pytest.raises(MqttProtocolError, match="longer than 4 bytes"):
        PacketReader().feed(b"\x30\xff\xff\xff\xff\x01")
    with pytest.raises(MqttProtocolError, match="topic of 300 bytes"):
        parse_publish(0x30, b"\x01\x2cab")


def test_connect_packet_carries_the_will() -> None:
    packet = connect_packet("fedring-a1", 5, will=("fedring/v1/agents/a1/status", b"lost", 1, True))
    [(first, body)] = PacketReader().feed(packet)
    assert first == 0x10 and body[:7] == b"\x00\x04MQTT\x04"
    assert body[7] == 0x02 | 0x04 | 0x08 | 0x20  # clean, will, will QoS 1, will retained
    assert body.endswith(b"\x00\x04lost")


# -- what fedring reads ---------------------------------------------------------------


@pytest.mark.parametrize(("numel", "g", "k", "dtype"), [(12_740, 256, 3, "fp16"),
                                                        (1000, 512, 5, "fp32")])  # fmt: skip
def test_star_payload_decodes_as_a_real_members_update(numel: int, g: int, k: int,
                                                        dtype: str) -> None:  # fmt: skip
    meta, body = star_payload(numel, g, k, dtype)
    payload = decode_payload(meta, bytearray(body), PayloadLimits(max_numel=numel))
    dense = payload.decompress()
    assert dense.shape == (numel,) and float(dense.abs().sum()) == 0.0
    groups = -(-numel // g)
    assert len(body) >= groups * k * (1 + 2 if dtype == "fp16" else 2 + 4) - 8


def test_the_generator_and_the_sampling_rule_it_shares_import_no_torch() -> None:
    """One process runs a thousand agents: torch would cost it ~300 MB and seconds."""
    code = ("import sys, fedring.lab.loadgen, fedring.engine.participation; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_params_hash_as_the_coordinator_hashes_them() -> None:
    params = Params()
    params.numel = 1000
    assert params.sha256(3) == flat_sha256(torch.full((1000,), 3.0))


class _Wire:
    """Stands in for a connection: keeps what an agent publishes."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.bytes_sent = 0

    def publish(self, topic: str, payload: bytes, **_: Any) -> None:
        self.sent.append((topic, payload))


def test_checkpoint_patches_rebuild_the_model_in_the_coordinators_replica() -> None:
    """Members 1..3 patch their slices of round 2 onto the head's round-1 upload: the
    coordinator's `Replica` ends with the parameters every agent claims, bit for bit."""
    params, key, world = Params(), b"k" * 32, 4
    params.numel = 1001  # not a multiple of the 3 patchers
    coordinator = ControlCodec("coordinator", key=key)
    replica = Replica()
    replica.reset(torch.from_numpy(params.at(1).copy()), 1)
    members = [f"a{i}" for i in range(world)]
    taken = None
    for rank, me in enumerate(members):
        agent = ProtocolAgent(me, LoadSettings("127.0.0.1", 1), params)
        wire = _Wire()
        agent.conn = wire  # type: ignore[assignment]
        agent.codec.key = key
        seg = Segment("job1", 0, key, rank, world, 0, {}, False, FrameLimits())
        agent._checkpoint(seg, 2, base=1)
        if rank == 0:
            assert wire.sent == []  # the head sends no patch after the first checkpoint
            continue
        [(topic, frame)] = wire.sent
        assert topic == f"fedring/v1/jobs/job1/to/coordinator/{me}"
        msg = coordinator.decode(me, frame)
        assert msg is not None and msg.kind == "model" and msg.doc["from"] == 1
        taken = replica.take(msg, members[1:])
    assert taken is not None and taken.params is not None, taken
    assert flat_sha256(taken.params) == params.sha256(2)


# -- a ring's chunks -------------------------------------------------------------------

RING = [f"a{i}" for i in range(5)]
NUMEL, G, K = 1001, 64, 3  # 16 groups over 5 members: chunks of 3 and 4 groups
KEY = b"r" * 32


def _shape(rank: int, k: int = K) -> RingShape:
    n = len(RING)
    return RingShape("job1.e0", RING[rank], rank, n, RING[(rank - 1) % n], RING[(rank + 1) % n],
                     NUMEL, G, k, "fp16")  # fmt: skip


class _Stub:
    """A real member's endpoint: frames handed in, frames sent kept."""

    def __init__(self, name: str) -> None:
        self.name, self.stats = name, LinkStats()
        self.inbox: list[Delivery] = []
        self.sent: list[tuple[str, bytes]] = []

    def send(self, dst: str, data: bytes, deadline: Deadline) -> None:
        self.sent.append((dst, data))

    def recv(self, deadline: Deadline) -> Delivery:
        if not self.inbox:
            raise TransportTimeout("nothing queued")
        return self.inbox.pop(0)

    def peers(self) -> frozenset[str]:
        return frozenset(RING)


def test_chunk_bounds_are_the_rings() -> None:
    for units, world in [(16, 5), (50, 100), (7, 7), (1, 3)]:
        assert chunk_bounds(units, world) == ring_chunk_bounds(units, world)


def test_a_real_ring_member_takes_protocol_chunks_and_sends_chunks_of_their_size() -> None:
    """Member a2 runs the real `Ring.exchange` between protocol peers a1 (its left) and
    a3 (its right): it accepts a1's frames at every step of both phases, and its own
    frames are a3's expected chunks, byte for byte the size a protocol agent sends."""
    stub = _Stub("a2")
    ring = Ring(PeerChannel(stub, "job1.e0", key=KEY), tuple(RING), timeout_s=1.0)  # type: ignore[arg-type]
    left, me, right = (RingPeer(_shape(r), KEY, FrameLimits()) for r in (1, 2, 3))
    bounds = ring_chunk_bounds(-(-NUMEL // G), len(RING))
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    for phase in ("rs", "ag"):
        for step in range(len(RING) - 1):
            stub.inbox += [Delivery("a1", f) for f in left.frames(0, step, phase)]
            sent_c, recv_c = RingPeer.plan(2, len(RING), step, phase)
            mine = GroupTopK(G, K, "fp16").compress(x, groups=bounds[sent_c])
            got = ring.exchange(mine, round=0, step=step, phase=phase, expect=SparseGroups,
                                span=bounds[recv_c])  # fmt: skip
            assert isinstance(got, SparseGroups)
            assert (got.group_start, got.group_start + got.n) == bounds[recv_c]
            frames = [data for _, data in stub.sent]
            stub.sent.clear()
            assert [len(f) for f in frames] == [len(f) for f in me.frames(0, step, phase)]
            assert len(encode_payload(mine)[1]) == me.stats.step_bodies[-1]
            for data in frames:
                right.take("a2", data)
            assert right.stats.refused == 0 and right.stats.frames_received == step + 1 + (
                len(RING) - 1 if phase == "ag" else 0)  # fmt: skip
    assert ring.channel.counters.snapshot() == {}  # nothing refused, nothing stashed away


def test_a_ring_peer_refuses_what_its_left_neighbour_would_not_send() -> None:
    right = RingPeer(_shape(3), KEY, FrameLimits())
    right.take("a2", RingPeer(_shape(2, k=4), KEY, FrameLimits()).frames(0, 0, "rs")[0])
    right.take("a1", RingPeer(_shape(1), KEY, FrameLimits()).frames(0, 0, "rs")[0])
    right.take("a2", b"\x03junk")
    good = RingPeer(_shape(2), KEY, FrameLimits())
    right.take("a2", good.frames(0, 0, "ag")[0])  # seq 0 again: a repeat, dropped
    right.take("a2", good.frames(5, 0, "rs")[0])  # a round far ahead
    assert right.stats.refused == 4 and right.stats.duplicates == 1
    right.take("a2", good.frames(0, 0, "rs")[0])
    assert right.stats.refused == 4 and right.stats.frames_received == 1


def test_a_ring_the_generator_cannot_replay_is_refused_by_name() -> None:
    doc = {"rank": 1, "world": 5, "peers": {"0": "a0", "1": "a1", "2": "a2"},
           "spec": {"policy": "bounded"}, "collective": "ring"}  # fmt: skip
    assert RingShape.from_manifest("a1", "j.e0", doc, 10, 3).left == "a0"
    with pytest.raises(ValueError, match="policy='exact'"):
        RingShape.from_manifest("a1", "j.e0", {**doc, "spec": {"policy": "exact"}}, 10, 3)
    with pytest.raises(ValueError, match=r"peers \[4\] beyond"):
        RingShape.from_manifest("a1", "j.e0", {**doc, "peers": {**doc["peers"], "4": "a4"}},
                                10, 3)  # fmt: skip


def test_an_agent_answers_a_ring_it_cannot_replay_with_a_refusal() -> None:
    """A fanout segment: the agent nacks it ("refused: ..."), as a daemon refuses a job,
    and runs nothing."""
    agent = ProtocolAgent("a1", LoadSettings("127.0.0.1", 1), Params())
    wire = _Wire()
    agent.conn = wire  # type: ignore[assignment]
    doc = {"job": "job1", "epoch": 0, "key": KEY.hex(), "rank": 1, "world": 3,
           "peers": {"0": "a0", "1": "a1", "2": "a2"}, "start_round": 0, "mode": "ring",
           "collective": "fanout", "spec": {"rounds": 3, "topology": "ring"}}  # fmt: skip
    agent._on_manifest(ControlMessage("manifest", "job1", "coordinator", 0, doc, b"", True))
    [(topic, frame)] = wire.sent
    msg = ControlCodec("coordinator", key=KEY).decode("a1", frame)
    assert topic == "fedring/v1/jobs/job1/to/coordinator/a1"
    assert msg is not None and msg.kind == "nack" and "collective='fanout'" in msg.doc["why"]
    assert agent.times.refused_jobs == 1 and agent.pending is None and agent.seg is None


def test_fit_tells_quadratic_from_linear() -> None:
    ns = [30, 100, 300, 1000]
    assert fit(ns, [0.5 + 0.01 * n for n in ns]).quadratic_share(1000) < 0.01
    assert fit(ns, [0.5 + 1e-5 * n * n for n in ns]).quadratic_share(1000) > 0.95
    rows = [{"mode": "star", "agents": n, "rounds": 10, "enrol_s": 0.01 * n,
             "enrol_after_hellos_s": 0.1,
             "coordinator_cpu_enrol_s": 0.1, "coordinator_cpu_rounds_s": 0.001 * n,
             "broker_cpu_rounds_s": 0.0, "train_s": 1.0, "coordinator_rss_mb": 300}
            for n in ns]  # fmt: skip
    found = fits(rows)
    assert found["star"]["coordinator CPU ms / round"]["per_agent"] == pytest.approx(0.1)
    assert "| star | 1000 | 10 | 10 |" in table(rows)


def test_repeated_runs_give_each_figures_median_and_keep_every_run() -> None:
    from fedring.lab.loadgen_report import median_row

    runs = [{"mode": "star", "agents": 30, "rounds": 2, "enrol_s": e, "train_s": t,
             "loadgen": {"enrol_phases": {"last_ack_s": e}}}
            for e, t in ((0.9, 1.0), (0.1, 3.0), (0.2, None))]  # fmt: skip
    row = median_row(runs)
    assert row["enrol_s"] == 0.2 and row["train_s"] == 2.0  # a figure a run lacks: left out
    assert row["coordinator_rss_mb"] is None and row["mode"] == "star"
    assert [r["enrol_s"] for r in row["runs"]] == [0.9, 0.1, 0.2]
    assert row["runs"][1]["enrol_phases"] == {"last_ack_s": 0.1}
    with pytest.raises(ValueError, match="one run at least"):
        median_row([])


def test_enrolment_phases_count_from_the_last_hello() -> None:
    from fedring.lab.loadgen import AgentTimes
    from fedring.lab.loadgen_fleet import enrol_phases

    times = [AgentTimes(hello=1.0, manifest=2.0, model=2.5, ack=2.5),
             AgentTimes(hello=1.5, manifest=2.25, model=3.0, ack=3.0)]  # fmt: skip
    assert enrol_phases(times) == {
        "first_manifest_s": 0.5, "last_manifest_s": 0.75, "first_model_s": 1.0,
        "last_model_s": 1.5, "first_ack_s": 1.0, "last_ack_s": 1.5,
    }  # fmt: skip
    assert enrol_phases([*times, AgentTimes()]) == {}  # one has not said hello yet


# -- against Mosquitto and a real coordinator -------------------------------------------


@pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")
@pytest.mark.parametrize(("mode", "n", "rounds"), [("star", 20, 3), ("async", 10, 3)])
def test_protocol_agents_run_a_real_coordinators_job(tmp_path: Path, mode: str, n: int,
                                                     rounds: int) -> None:  # fmt: skip
    from fedring.lab.loadgen_run import run_scenario

    row = run_scenario(mode, n, rounds, tmp_path, timeout_s=60.0)
    loadgen, summary = row["loadgen"], row["summary"]
    assert loadgen["finished"] == loadgen["acked"] == n
    assert loadgen["refused_frames"] == 0
    # The coordinator's status, and their manifest peers' as real agents (issue 29); every
    # agent's would be at least n (n - 1) / 2, one each time a later agent comes online.
    assert 0 < loadgen["statuses_heard"] <= 4 * n
    assert loadgen["numel"] == 12_740  # learnt from the checkpoint's model, as agents do
    assert row["enrol_s"] is not None and 0 < row["enrol_s"] < 30
    assert summary["reformations"] == 0
    counters = summary["counters"]
    assert not {"hash_mismatch", "checkpoint_not_final", "stash_evicted"} & set(counters), counters
    if mode == "star":
        assert summary["layout"] == f"star of {n}" and summary["rounds"] == rounds
        assert loadgen["rounds_max"] == rounds
    else:
        assert summary["layout"] == "async star" and summary["centre_rounds"] == 2 * n
    assert row["coordinator_rss_mb"] > 50 and row["coordinator_cpu_rounds_s"] >= 0


@pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")
def test_protocol_agents_run_a_real_coordinators_ring_job(tmp_path: Path) -> None:
    """Six agents, three rounds of a flat ring: 2(N-1) steps a round between neighbours,
    each chunk the size a real member's is; the coordinator sees a ring of daemons."""
    from fedring.lab.loadgen_run import run_scenario

    n, rounds = 6, 3
    row = run_scenario("ring", n, rounds, tmp_path, timeout_s=60.0)
    loadgen, summary = row["loadgen"], row["summary"]
    assert loadgen["finished"] == loadgen["acked"] == n and loadgen["refused_jobs"] == 0
    assert loadgen["refused_frames"] == loadgen["ring_duplicates"] == 0
    assert 0 < loadgen["statuses_heard"] <= 4 * n  # the coordinator's and the neighbours'
    assert summary["layout"] == f"ring of {n}" and summary["rounds"] == rounds
    assert summary["reformations"] == 0
    counters = summary["counters"]
    assert not {"hash_mismatch", "checkpoint_not_final", "stash_evicted"} & set(counters), counters
    assert loadgen["ring_steps"] == [rounds * 2 * (n - 1)] * n
    assert loadgen["ring_frames_sent"] == n * rounds * 2 * (n - 1)  # no chunk is split
    # Each rank's chunk bodies, step by step, as a real member's payloads of those groups.
    numel, g = loadgen["numel"], 256
    k = round(0.01 * g)
    bounds = ring_chunk_bounds(-(-numel // g), n)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    expected = [tuple(len(encode_payload(GroupTopK(g, k, "fp16").compress(
                    x, groups=bounds[RingPeer.plan(rank, n, step, phase)[0]]))[1])
                      for phase in ("rs", "ag") for step in range(n - 1))
                for rank in range(n)]  # fmt: skip
    assert sorted(map(tuple, loadgen["ring_step_bodies"])) == sorted(expected)
    assert loadgen["ring_body_bytes_sent"] == rounds * sum(map(sum, expected))


def test_a_fleet_refuses_no_agents() -> None:
    from fedring.lab.loadgen_fleet import LoadFleet

    with pytest.raises(ValueError, match="n=0"):
        LoadFleet(LoadSettings("127.0.0.1", 1), 0)
