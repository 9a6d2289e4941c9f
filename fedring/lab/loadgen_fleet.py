"""A fleet of protocol agents in one event loop, and what the processes around it cost.

`LoadFleet` starts N `loadgen.ProtocolAgent`s (a bounded number connecting at once),
says when every one has acknowledged its manifest and finished, and reports their
timings. `ProcSample` reads a process's CPU seconds and resident memory from
``/proc`` (Linux), which is how `bench/fleet_scale.py` measures the coordinator and
Mosquitto beside the fleet.

    fleet = LoadFleet(LoadSettings("127.0.0.1", port), 300)
    await fleet.start()
    await fleet.wait_done(timeout_s=600)
    print(fleet.report())
    await fleet.stop()
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedring.lab.loadgen import AgentTimes, LoadSettings, ProtocolAgent
from fedring.lab.loadgen_payloads import Params
from fedring.lab.loadgen_ring import RingStats


@dataclass(frozen=True)
class ProcSample:
    """A process's CPU (user + system) seconds and resident bytes at one moment."""

    t: float  # monotonic
    cpu_s: float
    rss: int

    @classmethod
    def read(cls, pid: int) -> ProcSample:
        """Raises `OSError` when the process is gone (or not on Linux)."""
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        return cls(time.monotonic(), cpu, pages * os.sysconf("SC_PAGE_SIZE"))


class LoadFleet:
    """N protocol agents named ``PREFIX-00000`` ... in this event loop."""

    def __init__(self, settings: LoadSettings, n: int, numel: int = 0) -> None:
        if n < 1:
            raise ValueError(f"a fleet of n={n} agents: n must be >= 1")
        self.settings = settings
        self.params = Params()
        self.params.numel = numel  # 0: learnt from the checkpoint's model, as agents do
        self.agents = [ProtocolAgent(f"{settings.prefix}-{i:05d}", settings, self.params)
                       for i in range(n)]  # fmt: skip
        self.connected_s = 0.0

    async def start(self) -> None:
        """Connect every agent (at most `connect_parallel` at once); each says hello."""
        gate = asyncio.Semaphore(self.settings.connect_parallel)
        t0 = time.monotonic()

        async def one(agent: ProtocolAgent) -> None:
            async with gate:
                await agent.start()

        await asyncio.gather(*(one(a) for a in self.agents))
        self.connected_s = time.monotonic() - t0

    @property
    def acked(self) -> int:
        return sum(1 for a in self.agents if a.times.ack)

    @property
    def finished(self) -> int:
        return sum(1 for a in self.agents if a.finished.is_set())

    def head_rounds(self) -> int:
        """Rounds (or async cycles) the busiest agent has completed."""
        return max(a.times.rounds for a in self.agents)

    async def wait_until(self, what: str, deadline_s: float, tick: float = 0.1) -> bool:
        """Until every agent has acked (`what` "acked") or finished ("finished")."""
        end = time.monotonic() + deadline_s
        while getattr(self, what) < len(self.agents):
            if time.monotonic() > end:
                return False
            await asyncio.sleep(tick)
        return True

    async def stop(self) -> None:
        for agent in self.agents:
            await agent.stop()
        await asyncio.sleep(0.2)  # let the goodbyes out

    def report(self) -> dict[str, Any]:
        times = [a.times for a in self.agents]
        hellos = [t.hello for t in times if t.hello]
        acks = [t.ack for t in times if t.ack]
        enrol = max(acks) - min(hellos) if hellos and len(acks) == len(times) else None
        return {
            "agents": len(self.agents),
            "connected_s": round(self.connected_s, 3),
            "enrol_s": None if enrol is None else round(enrol, 3),  # first hello to last ack
            # the coordinator's part: from the fleet's last hello to its last ack
            "enrol_after_hellos_s": None if enrol is None else round(max(acks) - max(hellos), 3),
            "enrol_phases": enrol_phases(times),
            "acked": len(acks),
            "finished": sum(1 for a in self.agents if a.finished.is_set()),
            "rounds_max": max(t.rounds for t in times),
            "refused_frames": sum(t.refused for t in times)
            + sum(r.refused for r in self._rings())
            + sum(
                v
                for a in self.agents
                for k, v in a.codec.counters.snapshot().items()
                if k.startswith("frame_")
            ),
            "statuses_heard": sum(t.statuses for t in times),  # N² with every agent's
            "refused_jobs": sum(t.refused_jobs for t in times),
            **self._ring_report(),
            "bytes_sent": sum(a.conn.bytes_sent for a in self.agents),
            "bytes_received": sum(a.conn.bytes_received for a in self.agents),
            "numel": self.params.numel,
        }

    def _rings(self) -> list[RingStats]:
        return [a.seg.ring.stats for a in self.agents if a.seg is not None and a.seg.ring]

    def _ring_report(self) -> dict[str, Any]:
        """A ring job's exchanges between the agents (none in other jobs)."""
        rings = self._rings()
        if not rings:
            return {}
        return {
            "ring_frames_sent": sum(r.frames_sent for r in rings),
            "ring_bytes_sent": sum(r.bytes_sent for r in rings),  # encoded frames
            "ring_body_bytes_sent": sum(r.body_bytes_sent for r in rings),
            "ring_duplicates": sum(r.duplicates for r in rings),
            "ring_steps": [r.steps for r in rings],
            "ring_step_bodies": [r.step_bodies for r in rings],  # each agent's first round
        }


def enrol_phases(times: list[AgentTimes]) -> dict[str, float]:
    """When, in seconds after the fleet's last hello, the first and the last agent got
    its manifest and its checkpoint's model and sent its ack: where the coordinator's
    part of enrolment goes (empty until every agent has said hello)."""
    if not times or not all(t.hello for t in times):
        return {}
    last = max(t.hello for t in times)
    out: dict[str, float] = {}
    for name in ("manifest", "model", "ack"):
        seen = [getattr(t, name) for t in times if getattr(t, name)]
        if seen:
            out[f"first_{name}_s"] = round(min(seen) - last, 3)
            out[f"last_{name}_s"] = round(max(seen) - last, 3)
    return out
