"""Thread-safe event counters: every refused frame, timeout and lost peer is counted.

Counters are what an operator reads after a run ("12 bad_mac from a3") and what
tests assert on; log lines say the same thing once each.
"""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """Named integer counters, safe to bump from transport threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
