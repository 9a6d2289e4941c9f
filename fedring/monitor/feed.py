"""`JobFeed`: the state of one running job, written by its runner, read by the views.

    >>> feed = JobFeed(job="d1", rounds=3, agents=2)
    >>> feed.members(["a0", "a1"], layout="ring")
    >>> feed.round({"round": 1, "loss": 2.3, "bytes_sent": 1000, "dense_bytes": 8000})
    >>> snap = feed.snapshot()
    >>> snap.round, snap.rows[-1]["loss"], snap.members, snap.bytes_sent
    (1, 2.3, ('a0', 'a1'), 1000.0)
    >>> feed.event("lost", "a1 lost")
    >>> [e["kind"] for e in feed.snapshot().events]
    ['lost']

Rows are kept whole up to `MAX_ROWS`; past that every other older row is dropped
(the curves keep their shape, memory stays bounded for a job of any length).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedring.counters import Counters

MAX_ROWS = 4096  # rows kept for the curves; older ones are thinned, never all dropped
MAX_EVENTS = 200
ROW_KEYS = ("round", "loss", "accuracy", "lr", "bytes_sent", "dense_bytes", "wall_s",
            "step_s", "comm_s", "compute_s", "compression_error")  # fmt: skip


@dataclass(frozen=True)
class Snapshot:
    """A copy of the feed at one moment: safe to read, render or serialise."""

    job: str
    phase: str  # "enrolling", "training", "done" or "failed"
    rounds: int  # the job's total
    round: int  # the latest round with a row (0: none yet)
    agents: int  # the job's number of agents
    online: int  # agents seen online (enrolment) or in the current ring
    members: tuple[str, ...]
    layout: str
    elapsed_s: float
    rows: tuple[dict[str, Any], ...]
    events: tuple[dict[str, Any], ...]
    counters: dict[str, int]
    version: int  # bumps on every write: a view redraws only when it changed

    @property
    def last(self) -> dict[str, Any]:
        return self.rows[-1] if self.rows else {}

    @property
    def bytes_sent(self) -> float:
        """Bytes the reporting member has sent so far (its rows are cumulative)."""
        return float(self.last.get("bytes_sent", 0.0))

    @property
    def accuracy(self) -> float | None:
        """The latest evaluated accuracy (rows without an evaluation skip it)."""
        for row in reversed(self.rows):
            acc = row.get("accuracy")
            if isinstance(acc, int | float):
                return float(acc)
        return None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the pace of the rounds so far; None before two rounds."""
        if len(self.rows) < 2 or self.round >= self.rounds:
            return None
        first, last = self.rows[0], self.rows[-1]
        t0, t1 = first.get("_t"), last.get("_t")
        done = int(last["round"]) - int(first["round"])
        if not isinstance(t0, float) or not isinstance(t1, float) or done <= 0:
            return None
        return (t1 - t0) / done * (self.rounds - self.round)

    def as_json(self) -> dict[str, Any]:
        """What the dashboard's ``/api/state`` serves: plain JSON, no NaN."""
        return {
            "job": self.job, "phase": self.phase, "rounds": self.rounds, "round": self.round,
            "agents": self.agents, "online": self.online, "members": list(self.members),
            "layout": self.layout, "elapsed_s": round(self.elapsed_s, 3),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
            "accuracy": self.accuracy, "bytes_sent": self.bytes_sent,
            "rows": [_plain(r) for r in self.rows], "events": list(self.events),
            "counters": self.counters, "version": self.version,
        }  # fmt: skip


def _plain(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items() if not k.startswith("_")}  # fmt: skip


@dataclass
class JobFeed:
    """The live state of one job. Every method is safe from any thread."""

    job: str = ""
    rounds: int = 0
    agents: int = 0
    counters: Counters = field(default_factory=Counters)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _rows: list[dict[str, Any]] = field(default_factory=list, repr=False)
    _events: deque[dict[str, Any]] = field(
        default_factory=lambda: deque(maxlen=MAX_EVENTS), repr=False
    )
    _members: tuple[str, ...] = ()
    _layout: str = ""
    _online: int = 0
    _phase: str = "enrolling"
    _start: float = field(default_factory=time.monotonic, repr=False)
    _version: int = 0

    def round(self, row: Mapping[str, Any]) -> None:
        """One round's metrics row (a redone round replaces the rows from it on)."""
        kept = {k: row[k] for k in ROW_KEYS if k in row}
        if not isinstance(kept.get("round"), int):
            return
        kept["_t"] = time.monotonic()
        with self._lock:
            while self._rows and self._rows[-1]["round"] >= kept["round"]:
                self._rows.pop()  # a re-formed ring runs these rounds again
            self._rows.append(kept)
            if len(self._rows) > MAX_ROWS:  # thin the older half, keep the newest
                half = len(self._rows) // 2
                self._rows = self._rows[:half:2] + self._rows[half:]
            self._phase = "training"
            self._version += 1

    def members(self, members: list[str] | tuple[str, ...], layout: str = "") -> None:
        with self._lock:
            self._members, self._online = tuple(members), len(members)
            self._layout = layout or self._layout
            self._version += 1

    def online(self, n: int) -> None:
        """Agents seen so far while enrolling."""
        with self._lock:
            self._online = n
            self._version += 1

    def event(self, kind: str, text: str) -> None:
        """Something an operator should see: a loss, a re-formation, a degrade."""
        with self._lock:
            at = self._rows[-1]["round"] if self._rows else 0
            self._events.append({"t": round(time.time(), 3), "kind": kind, "text": text,
                                 "round": at})  # fmt: skip
            self._version += 1

    def finish(self, ok: bool = True) -> None:
        with self._lock:
            self._phase = "done" if ok else "failed"
            self._version += 1

    def snapshot(self) -> Snapshot:
        with self._lock:
            rows = tuple(dict(r) for r in self._rows)
            return Snapshot(
                job=self.job, phase=self._phase, rounds=self.rounds,
                round=int(rows[-1]["round"]) if rows else 0, agents=self.agents,
                online=self._online, members=self._members, layout=self._layout,
                elapsed_s=time.monotonic() - self._start, rows=rows,
                events=tuple(self._events), counters=self.counters.snapshot(),
                version=self._version,
            )  # fmt: skip
