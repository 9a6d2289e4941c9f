"""An agent that refuses a manifest is in no job: it hears the coordinator's presence
alone, not that of the refused job's peers (issue 29), against a real Mosquitto."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedring.edge_agent.daemon import AgentDaemon
from fedring.transport import topics
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig, MqttLink
from fedring.wire.control import ControlMessage
from tests.monitor.test_watch_peers import _acked, _links, _until
from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")
COORD = topics.COORDINATOR


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with Mosquitto(workdir=tmp_path / "b") as b:
        yield b


def _manifest(mode: str) -> ControlMessage:
    """A manifest agent a refuses (its spec has an unknown field): a ring of two with b
    (what `read_segment` reads), or a pipeline's stage."""
    doc = {"key": "00" * 32, "job": "j", "epoch": 0, "world": 2, "peers": {"0": "a", "1": "b"},
           "rank": 0, "start_round": 0, "head": "a", "spec": {"no_such_field": 1},
           "members": ["a", "b"], "mode": mode}  # fmt: skip
    return ControlMessage("manifest", "j", COORD, 0, doc, b"", True)


@pytest.mark.parametrize("mode", ["ring", "pipeline"])
def test_an_agent_that_refuses_a_manifest_does_not_watch_its_peers(
    broker: Mosquitto, mode: str
) -> None:
    """A ring manifest is refused after its peers were watched (`read_segment` passed);
    a pipeline's before, but an earlier job's peers (here b) were still watched."""
    cfg = BrokerConfig.parse(broker.url)
    daemon = AgentDaemon(cfg, "a")
    coord = MqttLink(cfg, COORD, control_from=("*",), listen_hellos=True).connect()
    b = MqttLink(cfg, "b").connect()
    a = daemon.link = MqttLink(cfg, "a", counters=daemon.counters, statuses="peers").connect()
    with _links(a, b, coord):
        _until("a never saw the coordinator", lambda: a.peers() == {COORD})
        if mode == "pipeline":
            a.watch_peers(["b"])  # as the stage it ran before did
            _until("a never saw b", lambda: "b" in a.peers())
            assert daemon.stages.handle(_manifest(mode), a)
        else:
            daemon._on_manifest(_manifest(mode))
        assert daemon.counters.get("job_refused") == 1
        _acked(a)  # b's retained status, had a still watched b, has reached a
        assert a.peers() == {COORD}
        before = a.counters.get("status_unwatched")  # b's retained "online", if it beat the drop
        b.kill()
        _until("the coordinator never saw b lost", lambda: "b" not in coord.peers())
        _acked(a)
        assert a.counters.get("status_unwatched") == before
