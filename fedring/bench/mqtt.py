"""`fedring bench mqtt`: bytes per round as the broker counts them, beside fedring's own.

One Mosquitto on loopback (``sys_interval 1``), N agent daemons as processes, and
the coordinator in this process run the same job twice: dense (``compression =
"none"``) and group-top-k. For each run the bench reads the broker's
``$SYS/broker/bytes/received`` and ``.../sent`` before and after, and sets them
beside what fedring itself counted: the ring frames each agent sent, everything
each agent published (ring, metrics, the head's checkpoint uploads, acks), and
what the coordinator published. The broker's figures add MQTT's own bytes:
fixed headers, topic names, PUBACKs, keep-alive pings, and the $SYS messages this
bench subscribes to. The checkpoint stream (the members' patches every
`checkpoint_every` rounds, the head's dense model once a segment) is in
"published" and at the broker, not in "ring".
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fedring.config import JobSpec
from fedring.coordinator.service import Coordinator, Options
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig

log = logging.getLogger(__name__)
SYS_TOPICS = ("$SYS/broker/bytes/received", "$SYS/broker/bytes/sent")


@dataclass
class _Reading:
    value: int = 0
    at: float = 0.0  # time.monotonic() of arrival


class BrokerBytes:
    """The broker's byte totals, as it publishes them on $SYS every `sys_interval`."""

    def __init__(self, port: int) -> None:
        self._cond = threading.Condition()
        self._latest = {t: _Reading() for t in SYS_TOPICS}
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fedring-bench-sys")
        self._client.on_connect = lambda c, *_: c.subscribe([(t, 0) for t in SYS_TOPICS])
        self._client.on_message = self._on_message
        self._client.connect("127.0.0.1", port, keepalive=30)
        self._client.loop_start()

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        with self._cond:
            self._latest[msg.topic] = _Reading(int(msg.payload), time.monotonic())
            self._cond.notify_all()

    def fresh(self, timeout: float = 10.0) -> tuple[int, int]:
        """(received, sent) from a publication that left the broker after this call."""
        mark = time.monotonic()
        deadline = mark + timeout
        with self._cond:
            while any(r.at <= mark for r in self._latest.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no $SYS byte counts from the broker within {timeout} s")
                self._cond.wait(left)
            return tuple(self._latest[t].value for t in SYS_TOPICS)  # type: ignore[return-value]

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()


class _Daemons:
    """`fedring agent` processes, stopped with SIGTERM (then SIGKILL) by PID."""

    def __init__(self, url: str, logs: Path) -> None:
        self.url, self.logs = url, logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, ids: list[str]) -> None:
        for agent in ids:
            with open(self.logs / f"{agent}.log", "ab") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fedring", "agent", "--broker", self.url, "--id", agent],
                    stdout=out, stderr=out, start_new_session=True,
                ))  # fmt: skip

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _one(
    spec: JobSpec, cfg: BrokerConfig, sysbytes: BrokerBytes, out: Path,
    on_round: Callable[[int, dict[str, Any]], None] | None,
) -> dict[str, Any]:  # fmt: skip
    before = sysbytes.fresh()
    summary = Coordinator(spec, cfg, Options(out=out, on_round=on_round)).run()
    after = sysbytes.fresh()
    rounds = max(int(summary["rounds"]), 1)
    agent_bytes = summary["agent_bytes"]
    ring = [b["ring"] for b in agent_bytes.values()]
    published = sum(b["link"] for b in agent_bytes.values()) + summary["bytes_sent_by_coordinator"]
    received, sent = after[0] - before[0], after[1] - before[1]
    return {
        "compression": spec.compression,
        "density": spec.density if spec.compression != "none" else 1.0,
        "rounds": rounds,
        "final_accuracy": summary["final_accuracy"],
        "identical_models": summary["identical_models"],
        "ring_bytes_per_agent_per_round": sum(ring) / len(ring) / rounds,
        "published_bytes_per_round": published / rounds,
        "broker_received_per_round": received / rounds,
        "broker_sent_per_round": sent / rounds,
        "mqtt_overhead": received / published - 1.0 if published else 0.0,
        "wall_seconds": summary["wall_seconds"],
        "agent_bytes": agent_bytes,
        "bytes_sent_by_coordinator": summary["bytes_sent_by_coordinator"],
    }


def _labelled(
    on_round: Callable[[str, int, dict[str, Any]], None] | None, label: str
) -> Callable[[int, dict[str, Any]], None] | None:
    if on_round is None:
        return None
    return lambda r, row: on_round(label, r, row)


def run(
    agents: int = 4,
    rounds: int = 100,
    density: float = 0.01,
    dataset: str = "digits",
    seed: int = 0,
    checkpoint_every: int = 1,
    on_round: Callable[[str, int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Dense, then group-top-k, over one broker and one fleet; rows side by side."""
    base = JobSpec(
        agents=agents, dataset=dataset, rounds=rounds, eval_every=rounds, seed=seed,
        timeout_s=30.0, checkpoint_every=checkpoint_every,
    )  # fmt: skip
    jobs = [base.replace(compression="none"), base.replace(compression="group-topk",
                                                             density=density)]  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="fedring-bench-mqtt-"))
    rows = []
    with Mosquitto(sys_interval=1, workdir=work / "broker") as broker:
        cfg = BrokerConfig.parse(broker.url, username="coordinator")
        sysbytes = BrokerBytes(broker.port)
        daemons = _Daemons(broker.url, work)
        try:
            daemons.start([f"bench-{i}" for i in range(agents)])
            for spec in jobs:
                tick = _labelled(on_round, spec.compression)
                rows.append(_one(spec, cfg, sysbytes, work / spec.compression, tick))
        finally:
            daemons.stop()
            sysbytes.close()
    dense, sparse = rows
    return {
        "agents": agents,
        "rounds": rounds,
        "dataset": dataset,
        "checkpoint_every": checkpoint_every,
        "broker": "mosquitto (loopback)",
        "rows": rows,
        "broker_bytes_ratio": dense["broker_received_per_round"]
        / max(sparse["broker_received_per_round"], 1e-9),
        "ring_bytes_ratio": dense["ring_bytes_per_agent_per_round"]
        / max(sparse["ring_bytes_per_agent_per_round"], 1e-9),
        "logs": str(work),
    }
