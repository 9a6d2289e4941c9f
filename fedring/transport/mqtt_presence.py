"""Who is online, as one MQTT link sees it: retained presence, wills and heartbeats.

`Presence` reads peers' retained statuses (``agents/{id}/status``: online, offline, or
the will's ``lost``) and, on a *watching* link (the coordinator's), their heartbeats
(``agents/{id}/beat``): a peer that has beaten and then falls silent for SILENT_AFTER of
its announced keep-alives is taken for lost, a hung board the broker would see late.
`Heartbeat` is the thread that beats for our own link and ticks the watch.

Locking: `Presence` owns its state and its lock. paho's network thread (statuses,
beats), the heartbeat thread (silences), the grace timers of a "lost" and callers of
`peers` all go through it; events are emitted after the lock is let go.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import MembershipEvent
from fedring.transport.mqtt_broker import BrokerConfig
from fedring.transport.mqtt_connection import Connection
from fedring.wire.jsondoc import parse_document

log = logging.getLogger("fedring.transport.mqtt")

MAX_STATUS_BYTES = 1024
# Every link beats BEATS_PER_KEEPALIVE times a keep-alive; a watcher takes a peer that
# has beaten for lost after SILENT_AFTER keep-alives without one. The broker's own check
# (1.5 keep-alives, run only every 5 s by Mosquitto 2.0) would see a hung board late.
BEATS_PER_KEEPALIVE = 3
SILENT_AFTER = 1.25
WATCH_TICK_S = 0.25
MIN_KEEPALIVE_S = 1.0  # a presence announcing less is taken at this: no instant "lost"


@dataclass
class _Table:
    online: dict[str, str] = field(default_factory=dict)  # id -> session
    jobs: dict[str, str] = field(default_factory=dict)  # id -> the job its status names, or ""
    pending_lost: dict[str, str] = field(default_factory=dict)  # id -> session, unconfirmed
    keepalive: dict[str, float] = field(default_factory=dict)  # id -> its announced keep-alive
    # peer -> (session, its last beat, its silence limit: SILENT_AFTER x its keep-alive)
    beats: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    silent: dict[str, str] = field(default_factory=dict)  # peer -> session lost to silence


class Presence:
    """The peers online at our broker, from their statuses and (watching) their beats."""

    def __init__(self, cfg: BrokerConfig, me: str, counters: Counters,
                 emit: Callable[[str, list[MembershipEvent]], None],
                 connected: threading.Event) -> None:  # fmt: skip
        self.cfg, self.me, self.counters = cfg, me, counters
        self._emit = emit
        self._connected = connected  # our own link's: set by its connection
        self._lock = threading.Lock()
        self._table = _Table()
        self._drops = 0  # our disconnections so far: a pending "lost" from before one is void
        self._reconnected_at = -math.inf  # monotonic time of our latest reconnect

    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._table.online)

    def peers_in(self, job: str) -> dict[str, str]:
        """Online peers whose presence names `job`: id -> session."""
        with self._lock:
            jobs = self._table.jobs
            return {who: s for who, s in self._table.online.items() if jobs.get(who) == job}

    def connected(self, reconnect: bool) -> None:
        """Our link is up: beats sent while we were away never reached us."""
        now = time.monotonic()
        with self._lock:
            beats = self._table.beats
            self._table.beats = {who: (s, now, lim) for who, (s, _t, lim) in beats.items()}
            if reconnect:
                self._reconnected_at = now

    def disconnected(self) -> None:
        with self._lock:
            self._drops += 1

    def status(self, who: str, payload: bytes, retained: bool) -> None:
        """A peer's retained status (empty: cleared, taken as offline)."""
        if who == self.me:
            return
        state, session, job, keepalive = "offline", "", "", float(self.cfg.keepalive)
        if payload:  # an oversized one is refused (counted) by the parser
            try:
                doc = parse_document(payload, max_bytes=MAX_STATUS_BYTES, what="status")
                state, session = str(doc.get("state", "offline")), str(doc.get("session", ""))
                job = str(doc.get("job", ""))
                keepalive = announced_keepalive(doc.get("keepalive"), keepalive)
            except (ValueError, AttributeError):
                self.counters.add("bad_status")
                log.warning("%s: unreadable status from %s", self.me, who)
                return
        events: list[MembershipEvent] = []
        table = self._table
        with self._lock:
            known = table.online.get(who)
            table.pending_lost.pop(who, None)
            table.silent.pop(who, None)
            if state == "online":
                if known != session:
                    if known is not None:  # restarted without us seeing it go
                        events.append(MembershipEvent("lost", who))
                    events.append(MembershipEvent("joined", who))
                    table.online[who], table.jobs[who] = session, job
                    table.keepalive[who] = keepalive
            elif known is not None and (not session or session == known):
                if state == "lost":  # confirmed later: a broker going down sends every will
                    table.pending_lost[who] = session
                    grace = self._lost_grace(retained)
                    timer = threading.Timer(grace, self._confirm_lost, (who, session, self._drops))
                    timer.daemon = True
                    timer.start()
                else:
                    del table.online[who]
                    events.append(MembershipEvent("left", who))
        self._emit(who, events)

    def _lost_grace(self, retained: bool) -> float:
        """A will read right after our own (re)connect, or a retained one, may be left over
        from a broker restart (sent on its way down, or queued in our session while it was
        away): wait for the peer's reconnect. Any other is fresh: the broker saw it die."""
        settling = time.monotonic() - self._reconnected_at < self.cfg.restart_grace_s
        return self.cfg.restart_grace_s if retained or settling else self.cfg.lost_grace_s

    def _confirm_lost(self, who: str, session: str, drops: int) -> None:
        with self._lock:
            if self._table.pending_lost.get(who) != session:
                return  # it came back, or a newer status replaced this one
            if drops != self._drops or not self._connected.is_set():
                return  # we lost the broker meanwhile: the status will be re-read
            del self._table.pending_lost[who]
            self._table.online.pop(who, None)
        self._emit(who, [MembershipEvent("lost", who)])

    def beat(self, who: str, payload: bytes) -> None:
        """A beat is ``SESSION [KEEPALIVE]``; it counts only for the session the peer's
        presence announced, and its silence limit is SILENT_AFTER x the keep-alive that
        presence announced (never one a beat carries: one forged beat with a tiny
        keep-alive would have a live peer taken for lost at once).
        A watcher hears its own beats too (it subscribes to every agent's): ignored."""
        if who == self.me:
            return
        session = payload[:64].decode("ascii", "replace").partition(" ")[0]
        events: list[MembershipEvent] = []
        table = self._table
        with self._lock:
            known = table.online.get(who) or table.silent.get(who)
            if not session or session != known:
                self.counters.add("bad_beat")
                return
            limit = SILENT_AFTER * table.keepalive.get(who, float(self.cfg.keepalive))
            table.beats[who] = (session, time.monotonic(), limit)
            if table.silent.get(who) == session and who not in table.online:
                del table.silent[who]  # it was hung, not dead: it is back as it was
                table.online[who] = session
                events.append(MembershipEvent("joined", who))
        self._emit(who, events)

    def check_silences(self, now: float) -> None:
        """A peer that has beaten and then stayed silent for SILENT_AFTER keep-alives is
        lost (while we ourselves are connected: our own outage silences everyone)."""
        if not self._connected.is_set():
            return
        silent: list[tuple[str, float]] = []
        table = self._table
        with self._lock:
            for who, (session, last, limit) in table.beats.items():
                if now - last > limit and table.online.get(who) == session:
                    del table.online[who]
                    table.silent[who] = session
                    silent.append((who, now - last))
        for who, quiet in silent:
            self.counters.add("peer_silent")
            log.warning("%s: no heartbeat from %s for %.1f s; taking it for lost",
                        self.me, who, quiet)  # fmt: skip
            self._emit(who, [MembershipEvent("lost", who)])


class Heartbeat:
    """Our own beats (``SESSION KEEPALIVE`` at QoS 0, read by `Presence.beat`), every
    keepalive / BEATS_PER_KEEPALIVE s while `conn` is connected; on a watcher it also
    ticks `watch.check_silences`. `stop` ends it for good: a closed link, or one that
    stepped back for another holder of its id."""

    def __init__(self, conn: Connection, watch: Presence | None) -> None:
        self.conn, self._watch = conn, watch
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"beat-{self.conn.me}")  # fmt: skip
            self._thread.start()

    def _loop(self) -> None:
        conn = self.conn
        period = conn.cfg.keepalive / BEATS_PER_KEEPALIVE
        beat = f"{conn.session} {conn.cfg.keepalive}".encode()
        due = 0.0
        while not self.stop.wait(WATCH_TICK_S if self._watch else period):
            now = time.monotonic()
            client = conn.client
            if now >= due and client is not None and conn.connected.is_set():
                client.publish(topics.beat(conn.me), beat, qos=0)
                due = now + period
            if self._watch is not None:
                self._watch.check_silences(now)


def announced_keepalive(value: object, default: float) -> float:
    """The keep-alive a peer's presence announces, within what a broker accepts
    (1 s to 18 h; MQTT's own field is 16 bits); `default` if it announced none."""
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        return default
    return min(max(float(value), MIN_KEEPALIVE_S), 65535.0)  # type: ignore[arg-type]
