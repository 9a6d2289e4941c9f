"""The agents' CPU share during one grid run: whether the cell measured the link or the CPU.

Eight agents on a 2-core machine share two cores: there a run's time says more about
the CPU than about the link. `CpuShare` samples, every `PERIOD_S`, the CPU time
(``utime + stime`` of ``/proc/PID/stat``; not ``cutime``, which would count a
reaped child twice) of the processes on the agents' nodes and all their descendants: the
agent daemons, their delay proxies, Flower's SuperNodes, DDP's ranks. Their CPU
seconds over the wall seconds times the machine's cores is the run's
``agents_cpu_share`` (1.0: every core busy with the agents all along). A process
that ends between two samples loses at most its last period, so the share errs low.
Beside it ``machine_cpu_busy`` is the whole machine's busy fraction from
``/proc/stat`` (other users included), which says whether the agents could have had
more.

A run is CPU-bound when ``agents_cpu_share >= CPU_BOUND``: the agents alone kept
three quarters of the cores busy, so compute and codec, not the shaped link, set its
pace. The grid's table marks those runs rather than leaving them out.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

CPU_BOUND = 0.75  # agents' CPU seconds / (wall seconds x cores) from which a run is CPU-bound
PERIOD_S = 0.5
_TICK = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of `pid`; None if it is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    try:  # fields[0] is the state: ppid is field 4 of stat(5), utime and stime 14 and 15
        ppid = int(fields[1])
        ticks = int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None
    return ppid, ticks / _TICK


def tree_cpu(roots: list[int]) -> dict[int, float]:
    """CPU seconds of every live process in the trees under `roots`, by pid."""
    stats = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (found := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = found
    out: dict[int, float] = {}
    todo = [p for p in roots if p in stats]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out[pid] = stats[pid][1]
        todo += [child for child, (ppid, _) in stats.items() if ppid == pid]
    return out


def _machine() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot."""
    first = (_PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    values = [float(v) for v in first[:8]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


class CpuShare:
    """A context that samples the trees under `roots()` (called each period: processes
    start during a run) and gives `share` and `machine` when it ends."""

    def __init__(self, roots: Callable[[], list[int]], period_s: float = PERIOD_S) -> None:
        self.roots, self.period_s = roots, period_s
        self.cores = len(os.sched_getaffinity(0)) or 1
        self.base: dict[int, float] = {}
        self.seen: dict[int, float] = {}
        self.share = self.machine = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-share", daemon=True)

    def _sample(self) -> None:
        for pid, seconds in tree_cpu(self.roots()).items():
            self.seen[pid] = max(self.seen.get(pid, 0.0), seconds)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def __enter__(self) -> CpuShare:
        self.base = tree_cpu(self.roots())
        self.seen = dict(self.base)
        self._t0, self._m0 = time.monotonic(), _machine()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self._stop.set()
        self._thread.join(timeout=10.0)
        self._sample()
        wall = max(time.monotonic() - self._t0, 1e-9)
        used = sum(s - self.base.get(pid, 0.0) for pid, s in self.seen.items())
        self.share = round(max(used, 0.0) / (wall * self.cores), 3)
        busy, total = (b - a for a, b in zip(self._m0, _machine(), strict=True))
        self.machine = round(busy / total, 3) if total > 0 else 0.0
