"""The fleet as an operator sees it: one row per board, from what the broker carries.

`BoardTable` takes the three things every agent publishes about itself: its retained
hello (profile, architecture, versions, memory, start time, job: `edge_agent.daemon`),
its retained status (online, offline, or the will's lost: `transport.mqtt_connection`)
and its beats (QoS 0, ``SESSION KEEPALIVE rss=BYTES``: `transport.mqtt_presence`), and
tells each board's state at a given moment:

- ``offline``: it said goodbye;
- ``lost``: the broker sent its will (it died, or the broker saw it hang), or its beats
  stopped for SILENT_AFTER (1.25) x its keep-alive: a hung board shows as lost before the
  broker's own check (1.5 keep-alives, which Mosquitto 2.0 runs only every 5 s);
- ``online``: its status says so and, once we have listened long enough to know, it beats;
- ``unknown``: a hello without a status, or a status naming no state we know.

A board that has never beaten while we listened counts as silent only once some board's
beat has reached us: a user who may not read the beats (an ACL) would otherwise see the
whole fleet lost. `warnings` says so instead.

Everything here comes from broker users we do not trust (on an open broker, anyone):
each payload is bounded and read with the parsers the coordinator uses; an unreadable
one is counted (``bad_hello``, ``bad_status``, ``bad_beat``, ``bad_beat_field``...) and
noted on its board's row, never raised. Text is cut to 64 printable characters (a
terminal must not take a board's name for escape codes), and the table holds at most
MAX_BOARDS boards. Time is the caller's (``now``, monotonic seconds): tests need no waits.

Locking: the reader's network thread feeds the table and the command's thread reads
it, both under the table's one lock.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.mqtt_presence import (
    SILENT_AFTER,
    STATES,
    PeerStatus,
    parse_beat,
    parse_status,
)
from fedring.wire.control import ControlCodec

MAX_BOARDS = 4096  # ids tracked; more are counted as too_many_boards and ignored
MAX_HELLO_BYTES = 64 * 1024  # a real hello is about 1 KiB
MAX_TEXT = 64  # characters kept of any announced string
MAX_NOTES = 3  # the latest notes kept per board


@dataclass(frozen=True)
class Board:
    """One board's row. None or "": not announced (an older agent, or unreadable)."""

    id: str
    state: str  # online | lost | offline | unknown
    why: str  # what the state rests on
    profile: str
    link: str
    arch: str
    fedring: str
    torch: str
    threads: int | None
    rss_bytes: int | None
    mem_total_bytes: int | None
    last_beat_s: float | None  # seconds since its latest beat reached us
    keepalive_s: float | None
    job: str
    session: str
    started: float | None  # Unix time the agent started
    notes: tuple[str, ...]  # what was refused of it, latest last

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["notes"] = list(self.notes)
        if self.last_beat_s is not None:
            doc["last_beat_s"] = round(self.last_beat_s, 2)
        return doc


@dataclass
class _Entry:
    hello: dict[str, Any] = field(default_factory=dict)  # the fields read, checked
    status: PeerStatus | None = None
    online_since: float = 0.0  # when its current online status reached us
    beat_session: str = ""
    last_beat: float | None = None
    busy: float = 0.0  # seconds its latest beat said its next ones may wait behind its sends
    rss: int | None = None
    notes: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_NOTES))


class BoardTable:
    """Boards by id, fed from the broker's messages and read as `Board` rows."""

    def __init__(self, counters: Counters, default_keepalive: float = 5.0) -> None:
        self.counters = counters
        self.default_keepalive = default_keepalive
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._since: float | None = None  # when we began listening (None: not connected)
        self._beats_heard = 0

    # -- the reader's side ------------------------------------------------------------

    def listening(self, now: float) -> None:
        """Connected (again): silences count from now (beats sent while we were away
        never reached us)."""
        with self._lock:
            self._since = now
            for entry in self._entries.values():
                if entry.last_beat is not None:
                    entry.last_beat = now
                entry.online_since = now

    def paused(self) -> None:
        """Disconnected: nobody is taken for silent until we listen again."""
        with self._lock:
            self._since = None

    def hello(self, who: str, payload: bytes, now: float) -> None:
        """A board's retained hello (empty: cleared, as an agent does when it stops)."""
        fields, notes, why = read_hello(who, payload)
        with self._lock:
            entry = self._entry(who)
            if entry is None:
                return
            if why:
                self._refuse(entry, "bad_hello", f"hello: {why}")
                return
            entry.hello = fields
            for note in notes:
                self._refuse(entry, "bad_hello_field", f"hello: {note}")

    def status(self, who: str, payload: bytes, now: float) -> None:
        """A board's retained status: online, offline or lost (its will)."""
        try:
            status = parse_status(payload, self.default_keepalive)
        except (ValueError, AttributeError) as exc:
            with self._lock:
                entry = self._entry(who)
                if entry is not None:
                    self._refuse(entry, "bad_status", f"status: {exc}"[:120])
            return
        with self._lock:
            entry = self._entry(who)
            if entry is None:
                return
            old = entry.status
            if status.state not in STATES:
                self._refuse(entry, "bad_status", f"status: state {clean(status.state)!r}")
            if status.state == "online" and (old is None or old.state != "online"
                                             or old.session != status.session):  # fmt: skip
                entry.online_since = now
            entry.status = status

    def beat(self, who: str, payload: bytes, now: float) -> None:
        """A board's beat; it counts for the session its status names (or, before any
        status, for the session it carries)."""
        beat = parse_beat(payload)
        with self._lock:
            entry = self._entry(who)
            if entry is None:
                return
            status = entry.status
            if not beat.session or (status is not None and beat.session != status.session):
                self.counters.add("bad_beat")
                return
            entry.beat_session, entry.last_beat, entry.busy = beat.session, now, beat.busy
            self._beats_heard += 1
            if beat.rss is not None:
                entry.rss = beat.rss
            if beat.bad:
                self._refuse(entry, "bad_beat_field", f"beat: {beat.bad}")

    def _entry(self, who: str) -> _Entry | None:
        entry = self._entries.get(who)
        if entry is None:
            if len(self._entries) >= MAX_BOARDS:
                self.counters.add("too_many_boards")
                return None
            entry = self._entries[who] = _Entry()
        return entry

    def _refuse(self, entry: _Entry, counter: str, note: str) -> None:
        self.counters.add(counter)
        if not entry.notes or entry.notes[-1] != note:  # a repeated refusal is one note
            entry.notes.append(note)

    # -- the command's side -----------------------------------------------------------

    def boards(self, now: float) -> list[Board]:
        """Every board but the coordinator, by id."""
        with self._lock:
            return [self._row(who, e, now) for who, e in sorted(self._entries.items())
                    if who != topics.COORDINATOR]  # fmt: skip

    def coordinator(self, now: float) -> Board | None:
        with self._lock:
            entry = self._entries.get(topics.COORDINATOR)
            return None if entry is None else self._row(topics.COORDINATOR, entry, now)

    def decided(self, now: float) -> bool:
        """Whether every board its status calls online has beaten, or stayed silent past
        its limit, since we began listening: a one-shot look can stop."""
        with self._lock:
            if self._since is None:
                return False
            return all(self._beating(e) or self._quiet(e, now) > self._limit(e)
                       for e in self._entries.values()
                       if e.status is not None and e.status.state == "online")  # fmt: skip

    def warnings(self, now: float) -> list[str]:
        with self._lock:
            online = [e for e in self._entries.values()
                      if e.status is not None and e.status.state == "online"]  # fmt: skip
            out = []
            if (
                online
                and not self._beats_heard
                and self._since is not None
                and any(self._quiet(e, now) > self._limit(e) for e in online)
            ):
                out.append("no heartbeat reached us from any board: a hung board cannot be "
                           "told from a live one (may this user read "
                           f"{topics.ROOT}/agents/+/beat?)")  # fmt: skip
            if online and not any(e.hello for e in self._entries.values()):
                out.append("no hello read: profiles, versions and jobs are unknown (may this "
                           f"user read {topics.ROOT}/agents/+/hello?)")  # fmt: skip
            return out

    def _beating(self, entry: _Entry) -> bool:
        status = entry.status
        return entry.last_beat is not None and (
            status is None or entry.beat_session == status.session
        )

    def _limit(self, entry: _Entry) -> float:
        keepalive = entry.status.keepalive if entry.status else self.default_keepalive
        return SILENT_AFTER * keepalive + entry.busy  # as the coordinator's watch

    def _quiet(self, entry: _Entry, now: float) -> float:
        """Seconds since its latest beat, or since we could have heard one."""
        if self._since is None:
            return 0.0
        if self._beating(entry) and entry.last_beat is not None:
            return now - entry.last_beat
        return now - max(self._since, entry.online_since)

    def _row(self, who: str, entry: _Entry, now: float) -> Board:
        state, why = self._state(entry, now)
        hello, status = entry.hello, entry.status
        beating = self._beating(entry) and entry.last_beat is not None
        beat = now - entry.last_beat if beating and entry.last_beat is not None else None
        return Board(
            id=who, state=state, why=why, profile=hello.get("profile", ""),
            link=hello.get("link", ""), arch=hello.get("arch", ""),
            fedring=hello.get("fedring", ""), torch=hello.get("torch", ""),
            threads=hello.get("threads"),
            rss_bytes=entry.rss if entry.rss is not None else hello.get("rss"),
            mem_total_bytes=hello.get("mem_total"), last_beat_s=beat,
            keepalive_s=status.keepalive if status else None,
            job=(status.job if status and status.job else hello.get("job", "")),
            session=status.session if status else hello.get("session", ""),
            started=hello.get("started"), notes=tuple(entry.notes),
        )  # fmt: skip

    def _state(self, entry: _Entry, now: float) -> tuple[str, str]:
        status = entry.status
        if status is None:
            return "unknown", "no status read"
        if status.state == "offline":
            return "offline", "said goodbye" if status.session else "status cleared"
        if status.state == "lost":
            return "lost", "the broker sent its will"
        if status.state != "online":
            return "unknown", f"status says {clean(status.state)!r}"
        if self._since is None:
            return "online", "as the broker last said (we are reconnecting)"
        quiet, limit = self._quiet(entry, now), self._limit(entry)
        if quiet > limit and (self._beating(entry) or self._beats_heard):
            return "lost", f"no beat for {quiet:.1f} s (limit {limit:.1f} s)"
        return "online", "beating" if self._beating(entry) else "no beat heard yet"


def read_hello(who: str, payload: bytes) -> tuple[dict[str, Any], list[str], str]:
    """The fields of `who`'s hello a fleet view shows, notes on the fields left out (of
    the wrong type), and "" or why the whole hello is unreadable."""
    if not payload:
        return {}, [], ""
    if len(payload) > MAX_HELLO_BYTES:
        return {}, [], f"{len(payload)} bytes > {MAX_HELLO_BYTES}"
    refused = Counters()  # the codec counts (and logs) why; we name it on the row
    msg = ControlCodec(topics.COORDINATOR, counters=refused).decode(who, payload)
    if msg is None:
        return {}, [], ", ".join(sorted(refused.snapshot())) or "a part of a larger frame"
    if msg.kind != "hello":
        return {}, [], f"a {clean(msg.kind)!r} frame, not a hello"
    doc, notes = msg.doc, []
    out: dict[str, Any] = {}
    profile = doc.get("profile", {})
    if not isinstance(profile, dict):
        notes.append(f"field 'profile' is a {type(profile).__name__}")
        profile = {}
    texts = {"profile": profile.get("profile", profile.get("name", "")),
             "link": profile.get("link", ""), "arch": doc.get("machine", ""),
             "fedring": doc.get("fedring", ""), "torch": doc.get("torch", ""),
             "job": doc.get("job", ""), "session": doc.get("session", "")}  # fmt: skip
    for key, value in texts.items():
        if isinstance(value, str):
            out[key] = clean(value)
        else:
            notes.append(f"field {key!r} is a {type(value).__name__}, not text")
    for key in ("threads", "rss", "mem_total"):
        if key in doc:
            whole = count(doc[key])
            if whole is None:
                notes.append(f"field {key!r} = {clean(repr(doc[key]))} is not a count")
            out[key] = whole
    started = doc.get("started")
    if started is not None:
        if type(started) in (int, float) and math.isfinite(started) and started > 0:
            out["started"] = float(started)
        else:
            notes.append(f"field 'started' = {clean(repr(started))} is not a time")
    return out, notes, ""


def clean(text: str) -> str:
    """`text` cut to MAX_TEXT printable characters (no escape codes reach a terminal)."""
    return "".join(c for c in text[: 4 * MAX_TEXT] if c.isprintable())[:MAX_TEXT]


def count(value: object) -> int | None:
    """A whole number in [0, 2**63) from a document, else None."""
    if type(value) is int and 0 <= value < 2**63:
        return value
    return None
