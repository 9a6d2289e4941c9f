"""The live progress line on stderr, drawn from a `JobFeed` by its own thread.

On a terminal it is one line redrawn in place (rich's `Live`, transient: the summary
that follows replaces it); in a pipe or a log file it is a plain line each
`PIPE_EVERY_S` while the job moves, and at least every `PIPE_IDLE_S` while it waits,
so ``2> job.log`` shows what a job is doing without flooding. Never on stdout:
``--json`` keeps stdout to its one object. ``--quiet`` turns it off.

    >>> from fedring.monitor.feed import JobFeed
    >>> feed = JobFeed(job="d1", rounds=300, agents=4)
    >>> feed.members(["a0", "a1", "a2", "a3"], layout="ring")
    >>> feed.round({"round": 12, "loss": 0.4321, "accuracy": 0.9, "bytes_sent": 2_500_000})
    >>> line(feed.snapshot()).split(" elapsed")[0]
    'd1 round 12/300 acc 0.900 loss 0.432 sent 2.5 MB members 4/4 ring'
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.text import Text

from fedring.monitor.feed import JobFeed, Snapshot

TTY_EVERY_S = 0.5
PIPE_EVERY_S = 1.0  # a moving job: one line a second at most
PIPE_IDLE_S = 10.0  # a waiting one: a line now and then, so the log shows it is alive


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover - the loop returns


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def line(snap: Snapshot) -> str:
    """One progress line: round / total, accuracy, loss, bytes, members, ETA."""
    head = snap.job or "job"
    if snap.phase == "enrolling" and not snap.rows:
        if snap.agents and snap.online >= snap.agents:
            return f"{head} starting {snap.agents} agents {_clock(snap.elapsed_s)}"
        return f"{head} waiting for agents {snap.online}/{snap.agents} {_clock(snap.elapsed_s)}"
    parts = [head, f"round {snap.round}/{snap.rounds}"]
    if snap.accuracy is not None:
        parts.append(f"acc {snap.accuracy:.3f}")
    loss = snap.last.get("loss")
    if isinstance(loss, int | float):
        parts.append(f"loss {loss:.3f}")
    parts.append(f"sent {_size(snap.bytes_sent)}")
    members = f"members {len(snap.members)}/{snap.agents}" if snap.members else ""
    if members:
        parts.append(f"{members} {snap.layout}".rstrip())
    eta = snap.eta_s
    parts.append(f"elapsed {_clock(snap.elapsed_s)}")
    if eta is not None:
        parts.append(f"eta {_clock(eta)}")
    if snap.events:
        last = snap.events[-1]
        parts.append(f"| {last['kind']}: {last['text']}")
    return " ".join(parts)


class ProgressLine:
    """Draws `feed` on `stream` (stderr) until closed; a no-op when `quiet`.

    Use as a context manager around the job; the drawing thread is a daemon and
    stops at exit, after one last line in a pipe.
    """

    def __init__(self, feed: JobFeed, *, quiet: bool = False,
                 stream: TextIO | None = None) -> None:  # fmt: skip
        self.feed, self.quiet = feed, quiet
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Live | None = None

    def __enter__(self) -> ProgressLine:
        if self.quiet:
            return self
        if self.tty:
            console = Console(file=self.stream)
            self._live = Live(Text(line(self.feed.snapshot())), console=console,
                              transient=True, auto_refresh=False)  # fmt: skip
            self._live.start()
        self._thread = threading.Thread(target=self._draw, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._live is not None:
            self._live.stop()

    def _draw(self) -> None:
        seen, printed = -1, 0.0
        every = TTY_EVERY_S if self.tty else PIPE_EVERY_S
        while True:
            stopping = self._stop.wait(every)
            snap = self.feed.snapshot()
            now = time.monotonic()
            if self._live is not None:
                self._live.update(Text(line(snap)), refresh=True)
            elif snap.version != seen or now - printed >= PIPE_IDLE_S or stopping:
                try:
                    self.stream.write(line(snap) + "\n")
                    self.stream.flush()
                except (OSError, ValueError):  # a closed pipe: the job goes on unseen
                    return
                seen, printed = snap.version, now
            if stopping:
                return
