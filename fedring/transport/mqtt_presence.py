"""Who is online, as one MQTT link sees it: retained presence, wills and heartbeats.

`Presence` reads peers' retained statuses (``agents/{id}/status``: online, offline, or
the will's ``lost``) and, on a *watching* link (the coordinator's), their heartbeats
(``agents/{id}/beat``): a peer that has beaten and then falls silent for SILENT_AFTER of
its announced keep-alives is taken for lost, a hung board the broker would see late.
`Heartbeat` is the thread that beats for our own link and ticks the watch.

A beat is ``SESSION KEEPALIVE rss=BYTES``: the process's resident memory rides on the
beats a link sends anyway (one small QoS 0 message a third of a keep-alive), so a fleet
view (`fedring fleet`) reads it fresh at no extra traffic, where a retained update would
add a publish, and a broker write, per change. Only the session counts for liveness;
`parse_beat` reads the rest (bounded: MAX_BEAT_BYTES, MAX_BEAT_FIELDS; unknown keys are
skipped, so a newer agent may add one) and says why it skipped a malformed field, which
`Presence.beat` counts as ``bad_beat_field`` without ever refusing the beat itself.
`parse_status` reads a retained status the same way for `Presence` and the fleet view.

Locking: `Presence` owns its state and its lock. paho's network thread (statuses,
beats), the heartbeat thread (silences), the grace timers of a "lost" and callers of
`peers` all go through it; events are emitted after the lock is let go.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fedring.counters import Counters
from fedring.logs_limit import LogLimiter
from fedring.transport import topics
from fedring.transport.base import MembershipEvent
from fedring.transport.mqtt_broker import BrokerConfig
from fedring.transport.mqtt_connection import Connection
from fedring.wire.jsondoc import parse_document

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt

log = logging.getLogger("fedring.transport.mqtt")

MAX_STATUS_BYTES = 1024
# Every link beats BEATS_PER_KEEPALIVE times a keep-alive; a watcher takes a peer that
# has beaten for lost after SILENT_AFTER keep-alives without one. The broker's own check
# (1.5 keep-alives, run only every 5 s by Mosquitto 2.0) would see a hung board late.
BEATS_PER_KEEPALIVE = 3
SILENT_AFTER = 1.25
WATCH_TICK_S = 0.25
MIN_KEEPALIVE_S = 1.0  # a presence announcing less is taken at this: no instant "lost"
# A beat's ``busy``: the unacknowledged bytes ahead of it over our measured uplink, times
# BUSY_MARGIN; a watcher extends that beat's silence limit by it, up to MAX_BUSY_S (so a
# forged beat -- an ACL per id forbids those -- delays the verdict on a hung board by at
# most that; a forged stream of plain beats already delays it for ever).
BUSY_MARGIN = 1.5
MAX_BUSY_S = 600.0
MAX_BEAT_BYTES = 256  # a beat is ~30 bytes; a longer one's fields are not read
MAX_BEAT_FIELDS = 8  # KEY=VALUE fields read after SESSION KEEPALIVE
MAX_RSS_BYTES = 2**48  # 256 TiB: anything above is not a process's memory
STATES = ("online", "offline", "lost")  # what a status may say (the will says "lost")


@dataclass(frozen=True)
class PeerStatus:
    """A peer's retained status: its state, session, job ("" none) and keep-alive."""

    state: str
    session: str
    job: str
    keepalive: float


def parse_status(payload: bytes, default_keepalive: float) -> PeerStatus:
    """A status document (empty: cleared, taken as offline); a `ValueError` (a
    `FrameError`) says why one is unreadable: oversized, not JSON, too deep."""
    if not payload:
        return PeerStatus("offline", "", "", default_keepalive)
    doc = parse_document(payload, max_bytes=MAX_STATUS_BYTES, what="status")
    return PeerStatus(
        str(doc.get("state", "offline")), str(doc.get("session", "")), str(doc.get("job", "")),
        announced_keepalive(doc.get("keepalive"), default_keepalive),
    )  # fmt: skip


@dataclass(frozen=True)
class Beat:
    """One heartbeat: its session (all that liveness reads), and its fields.

    >>> parse_beat(b"3f2a 5 rss=1048576")
    Beat(session='3f2a', rss=1048576, bad='', busy=0.0)
    >>> parse_beat(b"3f2a 5 rss=lots").bad
    "field 'rss=lots': not a whole number of bytes in [0, 2**48]"
    >>> parse_beat(b"3f2a 5 rss=1 busy=7.5").busy
    7.5
    """

    session: str
    rss: int | None = None  # the process's resident bytes; None: not announced
    bad: str = ""  # why a field was skipped ("": none was)
    busy: float = 0.0  # seconds the sender's next beats may wait behind its sends


def parse_beat(payload: bytes) -> Beat:
    """``SESSION [KEEPALIVE [KEY=VALUE ...]]``: the session as `Presence` has always read
    it (the first word of the first 64 bytes), then at most MAX_BEAT_FIELDS fields of a
    beat of at most MAX_BEAT_BYTES ASCII bytes. The keep-alive is never taken from a beat
    (`Presence.beat`); unknown keys are skipped; a malformed field is named in ``bad``."""
    session = payload[:64].decode("ascii", "replace").partition(" ")[0]
    if len(payload) > MAX_BEAT_BYTES:
        return Beat(session, bad=f"beat of {len(payload)} bytes > {MAX_BEAT_BYTES}")
    try:
        words = payload.decode("ascii").split(" ")[2:]
    except UnicodeDecodeError:
        return Beat(session, bad="beat is not ASCII")
    if len(words) > MAX_BEAT_FIELDS:
        return Beat(session, bad=f"{len(words)} fields > {MAX_BEAT_FIELDS}")
    rss, busy, bad = None, 0.0, ""
    for word in words:
        key, eq, value = word.partition("=")
        if not eq:
            bad = f"field {word[:32]!r} is not KEY=VALUE"
        elif key == "rss":
            if value.isascii() and value.isdigit() and int(value) <= MAX_RSS_BYTES:
                rss = int(value)
            else:
                bad = f"field {word[:32]!r}: not a whole number of bytes in [0, 2**48]"
        elif key == "busy":
            seconds = _number(value)
            if seconds is not None and 0.0 <= seconds <= MAX_BUSY_S:
                busy = seconds
            else:
                bad = f"field {word[:32]!r}: not a number of seconds in [0, {MAX_BUSY_S:g}]"
    return Beat(session, rss, bad, busy)


def _number(text: str) -> float | None:
    """`text` as a finite float, or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``/proc/self/statm``; 0 elsewhere): a
    small file read, cheap enough for every beat (as `firmware_profiles.apply.runtime_rss`,
    which transport may not import: it pulls in torch)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Table:
    online: dict[str, str] = field(default_factory=dict)  # id -> session
    jobs: dict[str, str] = field(default_factory=dict)  # id -> the job its status names, or ""
    pending_lost: dict[str, str] = field(default_factory=dict)  # id -> session, unconfirmed
    keepalive: dict[str, float] = field(default_factory=dict)  # id -> its announced keep-alive
    # peer -> (session, its last beat, its silence limit: SILENT_AFTER x its keep-alive)
    beats: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    silent: dict[str, str] = field(default_factory=dict)  # peer -> session lost to silence
    fresh: set[str] = field(default_factory=set)  # watched anew: their first status not read

    def forget(self, who: str) -> None:
        for table in (self.online, self.jobs, self.pending_lost, self.silent):
            table.pop(who, None)
        self.keepalive.pop(who, None)
        self.beats.pop(who, None)
        self.fresh.discard(who)


class Presence:
    """The peers online at our broker, from their statuses and (watching) their beats."""

    def __init__(self, cfg: BrokerConfig, me: str, counters: Counters,
                 emit: Callable[[str, list[MembershipEvent]], None],
                 connected: threading.Event) -> None:  # fmt: skip
        self.cfg, self.me, self.counters = cfg, me, counters
        self._log = LogLimiter(log, f"presence messages refused by {me}")
        self._emit = emit
        self._connected = connected  # our own link's: set by its connection
        self._lock = threading.Lock()
        self._table = _Table()
        self._drops = 0  # our disconnections so far: a pending "lost" from before one is void
        self._reconnected_at = -math.inf  # monotonic time of our latest reconnect

    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._table.online)

    def silent(self) -> frozenset[str]:
        """Peers taken for lost because their beats stopped, not because they left: a
        hung (or starved) board that may beat again."""
        with self._lock:
            return frozenset(self._table.silent)

    def peers_in(self, job: str) -> dict[str, str]:
        """Online peers whose presence names `job`: id -> session."""
        with self._lock:
            jobs = self._table.jobs
            return {who: s for who, s in self._table.online.items() if jobs.get(who) == job}

    def watch(self, added: frozenset[str], removed: frozenset[str]) -> None:
        """Our link hears `added` peers' statuses from now on and `removed`'s no more
        (`StatusWatch`): the removed are forgotten without an event (we no longer know
        them); an added one's first status says what it was before we looked, so its
        "online" is no news (no "joined"), while its "offline" or will is a departure."""
        with self._lock:
            for who in removed:
                self._table.forget(who)
            self._table.fresh.update(added)

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
        try:  # an oversized one is refused (counted) by the parser
            peer = parse_status(payload, float(self.cfg.keepalive))
        except (ValueError, AttributeError):
            self.counters.add("bad_status")
            self._log.warning(who, "bad_status", "%s: unreadable status from %s", self.me, who)
            return
        state, session, job, keepalive = peer.state, peer.session, peer.job, peer.keepalive
        events: list[MembershipEvent] = []
        table = self._table
        with self._lock:
            known = table.online.get(who)
            fresh = who in table.fresh  # watched anew: gone by now if not online
            table.fresh.discard(who)
            table.pending_lost.pop(who, None)
            table.silent.pop(who, None)
            if state == "online":
                if known != session:
                    if known is not None:  # restarted without us seeing it go
                        events.append(MembershipEvent("lost", who))
                    if not fresh:
                        events.append(MembershipEvent("joined", who))
                    table.online[who], table.jobs[who] = session, job
                    table.keepalive[who] = keepalive
            elif fresh or (known is not None and (not session or session == known)):
                if state == "lost":  # confirmed later: a broker going down sends every will
                    table.pending_lost[who] = session
                    # A watched-anew peer's retained will is news to us, not a leftover.
                    grace = self._lost_grace(retained and not fresh)
                    timer = threading.Timer(grace, self._confirm_lost, (who, session, self._drops))
                    timer.daemon = True
                    timer.start()
                else:
                    table.online.pop(who, None)
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
        """A beat is ``SESSION [KEEPALIVE [rss=BYTES] [busy=SECONDS]]`` (`parse_beat`); it
        counts only for the session the peer's presence announced, and its silence limit
        is SILENT_AFTER x the keep-alive that presence announced (never one a beat
        carries: one forged beat with a tiny keep-alive would have a live peer taken for
        lost at once), plus the beat's ``busy``: the sender's next beats wait behind its
        sends (`Heartbeat`). A malformed field is counted (``bad_beat_field``) and
        skipped; the beat still counts. A watcher hears its own beats too (it subscribes
        to every agent's): ignored."""
        if who == self.me:
            return
        parsed = parse_beat(payload)
        session = parsed.session
        events: list[MembershipEvent] = []
        table = self._table
        with self._lock:
            known = table.online.get(who) or table.silent.get(who)
            if not session or session != known:
                self.counters.add("bad_beat")
                self._log.warning(who, "bad_beat", "%s: refused a beat of %s: session "
                                  "%.40r, its presence says %.40r", self.me, who, session,
                                  known)  # fmt: skip
                return
            if parsed.bad:
                self.counters.add("bad_beat_field")
                log.debug("%s: skipped a field of %s's beat: %s", self.me, who, parsed.bad)
            limit = SILENT_AFTER * table.keepalive.get(who, float(self.cfg.keepalive))
            limit += parsed.busy  # its next beats wait behind its sends (`Heartbeat`)
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
    """Our own beats (``SESSION KEEPALIVE rss=BYTES [busy=SECONDS]`` at QoS 0, read by
    `Presence.beat` and `fedring fleet`), every keepalive / BEATS_PER_KEEPALIVE s while
    `conn` is connected, and one ahead of a long send (`ahead`); on a watcher it also
    ticks `watch.check_silences`. `stop` ends it for good: a closed link, or one that
    stepped back for another holder of its id.

    A beat cannot overtake the bytes queued before it on our connection: on a slow
    uplink, behind a large payload, it reaches a watcher seconds late. ``busy`` says how
    long that may be (`busy_s`), so the watcher waits for it instead of taking a live
    board for lost (issue 29: a fan-out at 1 Mbit/s lost every member in round 0)."""

    def __init__(self, conn: Connection, watch: Presence | None) -> None:
        self.conn, self._watch = conn, watch
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._covered_until = 0.0  # monotonic end of the wait our last ``busy`` announced

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"beat-{self.conn.me}")  # fmt: skip
            self._thread.start()

    def _loop(self) -> None:
        conn = self.conn
        period = conn.cfg.keepalive / BEATS_PER_KEEPALIVE
        due = 0.0
        while not self.stop.wait(WATCH_TICK_S if self._watch else period):
            now = time.monotonic()
            client = conn.client
            if now >= due and client is not None and conn.connected.is_set():
                self._beat(client, self.busy_s(), now)
                due = now + period
            if self._watch is not None:
                self._watch.check_silences(now)

    def busy_s(self, more: int = 0) -> float:
        """Seconds our uplink needs, by its last measurement, for the bytes a beat
        published now waits behind (and `more` about to go), times BUSY_MARGIN; 0.0
        while the uplink is unmeasured."""
        up = self.conn.up_bps
        if up <= 0:
            return 0.0
        return min(BUSY_MARGIN * (self.conn.unacked_bytes() + more) / up, MAX_BUSY_S)

    def ahead(self, nbytes: int) -> None:
        """Before a send of `nbytes`: if it holds our next beats back past a beat
        period, a beat goes first to tell a watcher how long to wait (``busy=``). A send
        already covered by the last such beat sends none."""
        conn, client, now = self.conn, self.conn.client, time.monotonic()
        if not conn.cfg.heartbeat or self.stop.is_set() or client is None:
            return
        busy, period = self.busy_s(nbytes), conn.cfg.keepalive / BEATS_PER_KEEPALIVE
        if busy > period and now + busy > self._covered_until + period:
            self._beat(client, busy, now)

    def _beat(self, client: mqtt.Client, busy: float, now: float) -> None:
        conn = self.conn
        if not conn.connected.is_set():
            return
        payload = f"{conn.session} {conn.cfg.keepalive} rss={resident_bytes()}"
        if busy >= 0.1:
            payload += f" busy={math.ceil(busy * 10) / 10:.1f}"  # rounded up: never short
            self._covered_until = now + busy
        client.publish(topics.beat(conn.me), payload.encode(), qos=0)


def announced_keepalive(value: object, default: float) -> float:
    """The keep-alive a peer's presence announces, within what a broker accepts
    (1 s to 18 h; MQTT's own field is 16 bits); `default` if it announced none."""
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        return default
    return min(max(float(value), MIN_KEEPALIVE_S), 65535.0)  # type: ignore[arg-type]
