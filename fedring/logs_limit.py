"""Rate-limited warnings for per-message events on network paths.

One broker user publishing garbage in a loop must not fill the log (the disk): a
`LogLimiter` logs the first `burst` events of each (peer, reason) in full, then at
most one summary line per `interval_s` for that pair ("412 more refused frames
from 'x' (bad_mac) in the last 60 s"). Peer names come from the network, so the
pairs remembered are bounded (`max_keys`, the least recent forgotten first) and so
are the full lines for all pairs together (`max_lines` per interval: a flood of
made-up peer names gets one summary line too). Counters, not log lines, are the
exact record: bump the counter for every event and log through the limiter.

A summary is written when the next event of its pair comes after the interval, so
the last window of a flood that stops is told only by the counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Pair:
    logged: int = 0  # full lines written since the pair was last quiet
    held: int = 0  # events not written since `since`
    since: float = 0.0  # start of the summary window
    last: float = 0.0  # the pair's latest event


class LogLimiter:
    """Logs warnings about `what` ("refused frames") per (peer, reason), rate-limited.

    Parameters
    ----------
    logger
        Where the lines go.
    what
        What the events are, plural, for the summary lines.
    burst
        Full lines per (peer, reason) before only summaries are written; a pair quiet
        for a whole interval starts again with full lines.
    interval_s
        At most one summary line per pair per interval.
    max_keys
        Pairs remembered at once.
    max_lines
        Full lines per interval over all pairs; beyond it, one summary line.
    """

    def __init__(self, logger: logging.Logger, what: str, *, burst: int = 5,
                 interval_s: float = 60.0, max_keys: int = 256, max_lines: int = 50,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.logger = logger
        self.what = what
        self.burst = burst
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.max_lines = max_lines
        self._clock = clock
        self._lock = threading.Lock()
        self._pairs: OrderedDict[tuple[str, str], _Pair] = OrderedDict()
        self._lines = 0  # full lines in the current all-pairs window
        self._over = _Pair()  # events held because `max_lines` was reached

    def warning(self, peer: str, reason: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` as a warning, or hold it for the pair's next summary."""
        self._event(logging.WARNING, peer, reason, msg, args)

    def info(self, peer: str, reason: str, msg: str, *args: object) -> None:
        """As `warning`, at INFO: for drops that are expected now and then."""
        self._event(logging.INFO, peer, reason, msg, args)

    def exception(self, peer: str, reason: str, msg: str, *args: object) -> None:
        """As `warning`, at ERROR, from an ``except`` block: the full lines carry the
        traceback (as `logging.Logger.exception`), the summaries do not."""
        self._event(logging.ERROR, peer, reason, msg, args, exc_info=True)

    def _event(self, level: int, peer: str, reason: str, msg: str, args: tuple[object, ...],
               exc_info: bool = False) -> None:  # fmt: skip
        with self._lock:
            now = self._clock()
            self._roll_window(level, now)
            pair = self._pair(level, (peer, reason), now)
            if pair.logged >= self.burst:
                pair.held += 1
                if now - pair.since >= self.interval_s:
                    self._summary(level, pair, now, f"from {peer!r} ({reason})")
                return
            if self._lines >= self.max_lines:
                self._over.held += 1
                return
            pair.logged += 1
            pair.since = now
            self._lines += 1
        self.logger.log(level, msg, *args, exc_info=exc_info)

    def _pair(self, level: int, key: tuple[str, str], now: float) -> _Pair:
        pair = self._pairs.get(key)
        if pair is not None and now - pair.last >= self.interval_s:
            if pair.held:  # quiet since: report what it held, then log in full again
                self._summary(level, pair, pair.last, f"from {key[0]!r} ({key[1]})")
            pair = None
        if pair is None:
            pair = self._pairs[key] = _Pair(since=now)
            if len(self._pairs) > self.max_keys:
                self._pairs.popitem(last=False)
        self._pairs.move_to_end(key)
        pair.last = now
        return pair

    def _roll_window(self, level: int, now: float) -> None:
        if now - self._over.since < self.interval_s:
            return
        if self._over.held:
            self._summary(level, self._over, now, f"(over the limit of {self.max_lines} lines)")
        self._over.since = now
        self._lines = 0

    def _summary(self, level: int, pair: _Pair, now: float, whence: str) -> None:
        self.logger.log(level, "%d more %s %s in the last %.0f s", pair.held, self.what,
                            whence, now - pair.since)  # fmt: skip
        pair.held = 0
        pair.since = now
