"""The fleet-scale load generator: its MQTT packets, its frames as fedring reads them,
and small fleets of protocol agents against a real Mosquitto and a real coordinator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fedring.collective.payloads import decode_payload
from fedring.compression.payload import PayloadLimits
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
from fedring.lab.loadgen_payloads import Params, star_payload
from fedring.lab.loadgen_report import fit, fits, table
from fedring.training.models import flat_sha256
from fedring.transport.mosquitto import MosquittoMissing, mosquitto_binary
from fedring.wire.control import ControlCodec
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


def test_a_fleet_refuses_no_agents() -> None:
    from fedring.lab.loadgen_fleet import LoadFleet

    with pytest.raises(ValueError, match="n=0"):
        LoadFleet(LoadSettings("127.0.0.1", 1), 0)
