"""What a member holding the job key may still get wrong, on a real Mosquitto: a
metrics row whose round is no integer, a control message of a kind the coordinator
does not read, a checkpoint upload that is not whole float32 values, a bye whose
counters are not counts. Each is ignored, counted, and logged (rate-limited:
`fedring.logs_limit`). And a checkpoint complete before its round's row waits for it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fedring.config import JobSpec
from fedring.coordinator.checkpoint import Checkpoint
from fedring.coordinator.service import Coordinator, Options, _Epoch
from fedring.counters import Counters
from fedring.training.models import flat_bytes, flat_sha256
from fedring.transport import topics
from fedring.transport.base import Deadline
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig, MqttLink
from fedring.wire.control import ControlCodec
from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

KEY = b"k" * 32
JOB = "digits-0a1b2c3d"
MEMBERS = ["a0", "a1"]
LOGGER = "fedring.coordinator.segment"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(workdir=tmp_path_factory.mktemp("coord-refusals")) as b:
        yield b


class Side:
    """The coordinator mid-job on a real link, and member a0 (the head) with the key."""

    def __init__(self, url: str, out: Path) -> None:
        cfg = BrokerConfig.parse(url)
        self.counters = Counters()
        self.coord = Coordinator(JobSpec(agents=2), cfg, Options(out=out))
        self.coord.counters = self.counters
        self.coord.codec.counters = self.counters
        self.coord.codec.key = KEY
        self.coord.link = MqttLink(cfg, topics.COORDINATOR, control_from=("*",),
                                   listen_hellos=True, watch=True).connect()  # fmt: skip
        self.coord.ck = Checkpoint(job=JOB, key=KEY, spec={}, shards={a: i for i, a in
                                   enumerate(MEMBERS)}, model_sha256="", shard_manifest={},
                                   epoch=0, round=0, params=None)  # fmt: skip
        self.ep = _Epoch(0, list(MEMBERS), 0)
        self.a0 = MqttLink(cfg, "a0").connect()
        self.codec = ControlCodec("a0", key=KEY)
        # The coordinator's link subscribes to its topics before it watches statuses,
        # and the broker takes its packets in order: once it sees a0 online, what a0
        # sends reaches it (a flood sent right after `connect` can lose its first).
        deadline = time.monotonic() + 10
        while "a0" not in self.coord.link.peers():
            assert time.monotonic() < deadline, "the coordinator never saw a0 online"
            time.sleep(0.02)

    def handle_until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        """Read the coordinator's control queue as its epoch loop does, until `done`."""
        assert self.coord.link is not None
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"counters: {self.counters.snapshot()}"
            item = self.coord._next(0.1)
            if item is not None and item.kind != "hello":
                self.coord._on_item(self.ep, item)

    def close(self) -> None:
        self.a0.close()
        assert self.coord.link is not None
        self.coord.link.close()


@pytest.fixture
def side(broker: Mosquitto, tmp_path: Path) -> Iterator[Side]:
    s = Side(broker.url, tmp_path / "out")
    yield s
    s.close()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_metrics_rows_without_an_integer_round_are_counted_and_logged(
    side: Side, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, LOGGER):
        for i in range(40):
            [frame] = side.codec.encode("metrics", JOB, topics.COORDINATOR,
                                        {"epoch": 0, "round": "x" if i % 2 else 1.5})  # fmt: skip
            side.a0.publish(topics.metrics(JOB, "a0"), frame, Deadline.after(5))
        side.handle_until(lambda: side.counters.get("bad_metrics") >= 40)
    assert side.counters.get("bad_metrics") == 40
    got = _warnings(caplog)
    assert len(got) == 5, got
    assert got[0] == "a metrics row from a0 with round=1.5 (not an integer): ignored"
    assert side.coord.rows == {}


def test_a_control_kind_the_coordinator_does_not_read_is_counted_and_logged(
    side: Side, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, LOGGER):
        for kind in ("shard", "manifest", "chunk"):
            [frame] = side.codec.encode(kind, JOB, topics.COORDINATOR, {"epoch": 0})
            side.a0.send_to(JOB, topics.COORDINATOR, frame, Deadline.after(5))
        side.handle_until(lambda: side.counters.get("control_unknown_kind") >= 3)
    assert side.counters.get("control_unknown_kind") == 3
    assert _warnings(caplog)[0] == ("a 'shard' message from a0 in job digits-0a1b2c3d: "
                                    "not a kind the coordinator reads; ignored")  # fmt: skip


def test_a_checkpoint_of_no_whole_float32_values_is_counted_and_logged(
    side: Side, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, LOGGER):
        for frame in side.codec.encode("model", JOB, topics.COORDINATOR, {"epoch": 0},
                                       b"\x00" * 7, round=3):  # fmt: skip
            side.a0.send_to(JOB, topics.COORDINATOR, frame, Deadline.after(5))
        side.handle_until(lambda: side.counters.get("frame_shape_mismatch") >= 1)
    assert _warnings(caplog) == [
        "checkpoint of round 3 from a0: 7 bytes, not whole float32 values: not saved"
    ]


def test_a_bye_whose_counters_are_not_counts_is_kept_without_them(
    side: Side, caplog: pytest.LogCaptureFixture
) -> None:
    """The summary shows each member's counters (`agent_counters`): a bye may not put
    anything but names and counts there."""
    bad = {"frame_malformed": {"nested": [1, 2, 3]}, "x": 1}
    with caplog.at_level(logging.WARNING, LOGGER):
        [frame] = side.codec.encode("bye", JOB, topics.COORDINATOR,
                                    {"epoch": 0, "sha256": "ab", "counters": bad,
                                     "threads": "many"})  # fmt: skip
        side.a0.send_to(JOB, topics.COORDINATOR, frame, Deadline.after(5))
        side.handle_until(lambda: "a0" in side.ep.done)
    assert side.counters.get("bad_agent_counters") == 1
    assert side.ep.done["a0"]["counters"] == {} and side.ep.done["a0"]["sha256"] == "ab"
    assert _warnings(caplog) == [
        "the bye of a0: field 'counters' entry 'frame_malformed' = {'nested': [1, 2, 3]}: "
        "not a non-negative integer; its counters are left out"
    ]


def test_a_checkpoint_whose_sha256_is_wrong_is_counted_each_time_and_logged_rate_limited(
    side: Side, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, LOGGER):
        for _ in range(40):
            for frame in side.codec.encode("model", JOB, topics.COORDINATOR,
                                           {"epoch": 0, "sha256": "00" * 32},
                                           b"\x00" * 16, round=3):  # fmt: skip
                side.a0.send_to(JOB, topics.COORDINATOR, frame, Deadline.after(5))
        side.handle_until(lambda: side.counters.get("checkpoint_bad_sha256") >= 40)
    assert side.counters.get("checkpoint_bad_sha256") == 40
    got = _warnings(caplog)
    assert len(got) == 5, got
    assert got[0] == "checkpoint of round 3 from a0: sha256 mismatch: not saved"
    assert side.coord.ck is not None and side.coord.ck.round == 0  # nothing saved


def test_model_hashes_that_disagree_count_once_a_round(side: Side, broker: Mosquitto) -> None:
    """Every member's row at an evaluation carries its model's hash: a round whose
    hashes disagree counts `hash_mismatch` once, however many rows come after."""
    a1 = MqttLink(BrokerConfig.parse(broker.url), "a1").connect()
    taken, on_metrics = [], side.coord._on_metrics

    def counted(ep: _Epoch, msg: Any) -> bool:
        taken.append(msg.src)
        return on_metrics(ep, msg)

    side.coord._on_metrics = counted  # type: ignore[method-assign]
    try:
        assert side.coord.link is not None
        deadline = time.monotonic() + 10
        while "a1" not in side.coord.link.peers():
            assert time.monotonic() < deadline, "the coordinator never saw a1 online"
            time.sleep(0.02)
        sent = 0
        for rnd, shas in ((5, ("aa", "bb", "aa", "bb")), (6, ("cc", "cc")), (7, ("dd", "ee"))):
            for i, sha in enumerate(shas):
                who, link = ("a0", side.a0) if i % 2 == 0 else ("a1", a1)
                [frame] = ControlCodec(who, key=KEY).encode(
                    "metrics", JOB, topics.COORDINATOR,
                    {"epoch": 0, "round": rnd, "sha256": sha, "accuracy": 0.5},
                )  # fmt: skip
                link.publish(topics.metrics(JOB, who), frame, Deadline.after(5))
                sent += 1
                side.handle_until(lambda n=sent: len(taken) >= n)  # type: ignore[misc]  # in order
    finally:
        a1.close()
    assert side.counters.get("hash_mismatch") == 2  # rounds 5 and 7; round 5's 4 rows once
    assert side.coord.mismatched == {5, 7}


def test_a_checkpoint_waits_for_the_heads_row_of_its_round(side: Side) -> None:
    """The checkpoint of round 3 can be complete before the head's row 3 arrives: it is
    saved (and acked) only once that row is written, so a coordinator killed in between
    resumes from round 0 with no row missing, not from round 3 without row 3."""
    params = torch.arange(4, dtype=torch.float32)
    for frame in side.codec.encode("model", JOB, topics.COORDINATOR,
                                   {"epoch": 0, "sha256": flat_sha256(params)},
                                   flat_bytes(params), round=3):  # fmt: skip
        side.a0.send_to(JOB, topics.COORDINATOR, frame, Deadline.after(5))
    side.handle_until(lambda: bool(side.coord.held))
    assert side.coord.ck is not None and side.coord.ck.round == 0  # not saved yet
    assert not (side.coord.opts.out / "checkpoint.pt").exists()
    for rnd in (1, 2, 3):
        [frame] = side.codec.encode("metrics", JOB, topics.COORDINATOR,
                                    {"epoch": 0, "round": rnd, "loss": 1.0})  # fmt: skip
        side.a0.publish(topics.metrics(JOB, "a0"), frame, Deadline.after(5))
        side.handle_until(lambda r=rnd: r in side.coord.rows)  # type: ignore[misc]
        assert side.coord.ck.round == (3 if rnd == 3 else 0)
    assert side.coord.held == [] and torch.equal(side.coord.ck.params, params)
    rows = [json.loads(line)["round"] for line in (side.coord.opts.out / "metrics.jsonl").open()]
    assert rows == [1, 2, 3]
