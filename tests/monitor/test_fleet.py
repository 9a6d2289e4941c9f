"""`fedring fleet` over a real Mosquitto and four real agent daemons (issue 31, item 2).

The agents beat with a 4 s keep-alive; one is hung (SIGSTOP: its socket stays open, so
the broker says nothing for 1.5 keep-alives plus up to 5 s) and one is killed (SIGKILL:
the broker sends its will at once). A watching `fedring fleet --watch --json` must show
the hung one lost within 1.5x its keep-alive of the stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from typer.testing import CliRunner

from fedring.cli import app
from fedring.counters import Counters
from fedring.fleet import BoardTable
from fedring.fleet_watch import FleetReader
from fedring.transport import topics
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt_broker import BrokerConfig
from tests.mqtt.conftest import MISSING, Fleet, coordinator, finish_after, job_toml, wait_for

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

KEEPALIVE = 4
AGENTS = [f"a{i}" for i in range(4)]


@pytest.fixture(scope="module")
def boards(broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Four daemons announcing a 4 s keep-alive, once the fleet view sees every hello."""
    fleet = Fleet(broker.url, tmp_path_factory.mktemp("fleet-logs"),
                  extra={a: ["--keepalive", str(KEEPALIVE)] for a in AGENTS})  # fmt: skip
    for agent in AGENTS:
        fleet.start(agent)
    table = BoardTable(Counters())
    reader = FleetReader(BrokerConfig.parse(broker.url), table).start()
    try:
        wait_for(lambda: sum(b.fedring != "" and b.state == "online"
                             for b in table.boards(time.monotonic())) == 4,
                 60, "four agents' hellos")  # fmt: skip
    finally:
        reader.close()
    yield fleet
    for proc in fleet.procs.values():  # a stopped one would not take its SIGTERM
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    fleet.stop()


def fleet_cli(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "fedring", "fleet", "--broker", url, *args]


def test_fleet_json_lists_every_board_with_every_field(boards: Fleet) -> None:
    done = CliRunner().invoke(app, ["fleet", "--broker", boards.url, "--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    rows = {b["id"]: b for b in doc["boards"]}
    assert sorted(rows) == AGENTS and doc["refused"] == {} and doc["warnings"] == []
    for b in rows.values():
        assert b["state"] == "online" and b["why"] == "beating", b
        assert b["profile"] and b["link"] and b["arch"] and b["session"], b
        assert b["fedring"] == "0.1.0" and b["torch"].startswith("2."), b
        assert 10 << 20 < b["rss_bytes"] < b["mem_total_bytes"], b  # from its beats
        assert 0 <= b["last_beat_s"] < KEEPALIVE and b["keepalive_s"] == KEEPALIVE, b
        assert b["job"] == "" and 0 < time.time() - b["started"] < 600, b


def test_each_board_names_the_job_it_is_in_and_none_once_it_is_done(
    boards: Fleet, tmp_path: Path
) -> None:
    table = BoardTable(Counters())
    reader = FleetReader(BrokerConfig.parse(boards.url), table).start()
    jobs: set[tuple[str, ...]] = set()

    def in_one_job() -> bool:
        names = tuple(sorted({b.job for b in table.boards(time.monotonic())}))
        jobs.add(names)
        return len(names) == 1 and names[0] != ""

    try:
        # long enough that every board's status names it at once, even under load (a
        # 2-round job once ended before the last board's status came, on 2 busy cores)
        job = job_toml(tmp_path, dataset="synthetic", rounds=40, eval_every=40)
        proc = coordinator(boards.url, job, tmp_path / "run")
        summary = finish_after(proc, lambda: wait_for(in_one_job, 60, "the job's name"))
        assert (summary["job"],) in jobs
        wait_for(lambda: {b.job for b in table.boards(time.monotonic())} == {""}, 20, "no job")
    finally:
        reader.close()


class Watch:
    """`fedring fleet --watch --json`: its JSON lines as they arrive, with their time."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(fleet_cli(url, "--watch", "--json"), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), json.loads(line)))

    def first(self, since: float, check: Any, timeout: float, what: str) -> float:
        """When the first line after `since` whose states pass `check` arrived."""
        found: list[float] = []

        def seen() -> bool:
            for at, doc in list(self.lines):
                if at >= since and check({b["id"]: b["state"] for b in doc["boards"]}):
                    found.append(at)
                    return True
            return False

        wait_for(seen, timeout, what)
        return found[0]

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(5)
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read().decode(errors="replace")


def test_a_hung_board_shows_lost_within_1_5_keepalives_and_a_killed_one_at_once(
    boards: Fleet,
) -> None:
    watch = Watch(boards.url)
    try:
        watch.first(0.0, lambda s: s == dict.fromkeys(AGENTS, "online"), 30, "four online")
        stopped = time.monotonic()
        os.kill(boards.procs["a1"].pid, signal.SIGSTOP)  # hung: connected, silent
        boards.kill("a2")  # dead: the broker sends its will
        killed = time.monotonic()
        at = watch.first(killed, lambda s: s["a2"] == "lost", 10, "a2 lost")
        assert at - killed < KEEPALIVE, "a killed board's will is read at once"
        at = watch.first(stopped, lambda s: s["a1"] == "lost", 3 * KEEPALIVE, "a1 lost")
        assert at - stopped <= 1.5 * KEEPALIVE, f"hung a1 seen lost after {at - stopped:.2f} s"
        _, doc = watch.lines[-1]
        rows = {b["id"]: b for b in doc["boards"]}
        assert rows["a0"]["state"] == rows["a3"]["state"] == "online"
        assert "no beat for" in rows["a1"]["why"] and "will" in rows["a2"]["why"]
    finally:
        os.kill(boards.procs["a1"].pid, signal.SIGCONT)
        code, err = watch.stop()
    assert code == 0, err


def test_the_coordinators_user_is_refused_and_a_missing_broker_is_named() -> None:
    runner = CliRunner()
    done = runner.invoke(app, ["fleet", "--broker", "mqtt://127.0.0.1:1", "--username",
                               "coordinator"])  # fmt: skip
    assert done.exit_code == 2 and "coordinator" in done.output
    done = runner.invoke(app, ["fleet", "--broker", "mqtt://127.0.0.1:1", "--timeout", "2"])
    assert done.exit_code == 1 and "refused the connection" in done.output


def test_junk_any_user_retains_is_noted_and_counted_never_fatal(boards: Fleet) -> None:
    junk = {topics.hello("mallory"): b"\xff" * 64, topics.status("mallory"): b"{" * 3000,
            topics.hello("a0"): b"not a frame"}  # fmt: skip
    cfg = BrokerConfig.parse(boards.url)
    spy = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fleet-spy", protocol=mqtt.MQTTv311)
    spy.connect(cfg.host, cfg.port)
    spy.loop_start()
    try:
        for topic, payload in junk.items():
            spy.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
        spy.publish(topics.beat("a0"), b"forged-session 4 rss=1", qos=1).wait_for_publish(10)
        done = CliRunner().invoke(app, ["fleet", "--broker", boards.url, "--json"])
        assert done.exit_code == 0, done.output
        doc = json.loads(done.stdout)
        rows = {b["id"]: b for b in doc["boards"]}
        assert rows["mallory"]["state"] == "unknown" and len(rows["mallory"]["notes"]) == 2
        assert rows["a0"]["notes"] and rows["a0"]["state"] == "online"  # it still beats
        assert doc["refused"]["bad_hello"] == 2 and doc["refused"]["bad_status"] == 1
    finally:
        for topic in junk:  # the daemons' own hellos are re-sent only on a change of job
            spy.publish(topic, b"", qos=1, retain=True).wait_for_publish(10)
        spy.disconnect()
        spy.loop_stop()
