"""What the coordinator knows of its agents, and the ring policy it draws from it.

Each agent's retained hello carries its board profile, a generic step time and its
measured round-trip bandwidth to the broker; its ack of a segment carries the
time of one training step of the job's own model. From these the coordinator
orders the ring (fastest link first, then the faster board), picks the ring's
frame size (the smallest any member's board takes), and sizes how long it waits
without progress before it calls a ring stalled. Every announced figure is
checked: anything but a finite number >= 0 counts as unknown (0).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import Any

from fedring.collective.cost import Probe


def number(value: Any) -> float:
    """A figure an agent announced (hello, ack): finite and >= 0, else 0 (unknown)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    try:
        figure = float(value)
    except OverflowError:  # an int beyond any float: the wire refuses those, others may not
        return 0.0
    return figure if math.isfinite(figure) and figure >= 0 else 0.0


class Hellos(dict[str, dict[str, Any]]):
    """Agent -> its hello, counting the writes (`version`): what `Fleet.stall` reads from
    them changes only when this does."""

    version = 0

    def __setitem__(self, agent: str, hello: dict[str, Any]) -> None:
        self.version += 1
        super().__setitem__(agent, hello)

    def __delitem__(self, agent: str) -> None:
        self.version += 1
        super().__delitem__(agent)

    def pop(self, agent: str, *default: Any) -> Any:
        self.version += 1
        return super().pop(agent, *default)


@dataclass
class Fleet:
    hellos: dict[str, dict[str, Any]] = field(default_factory=Hellos)  # agent -> its hello
    step_s: dict[str, float] = field(default_factory=dict)  # a step of the job's model
    numel: int = 0  # parameters of the job's model, from the first ack
    # `stall`'s last answer and what it depended on: the segment's loop asks after every
    # control message, and working it out is O(N) (N^2 a round for a thousand members).
    _stall: tuple[list[str], tuple[Any, ...], float] | None = field(default=None, repr=False)
    _acks: int = field(default=0, repr=False)  # on_ack calls: step_s and numel change there

    def __post_init__(self) -> None:
        if not isinstance(self.hellos, Hellos):
            self.hellos = Hellos(self.hellos)

    def on_ack(self, agent: str, doc: dict[str, Any]) -> None:
        self._acks += 1
        if "step_s" in doc:
            self.step_s[agent] = number(doc["step_s"])
        self.numel = self.numel or int(number(doc.get("numel", 0)))

    def link(self, agent: str) -> float:
        return number(self.hellos.get(agent, {}).get("link_bps"))

    def profile(self, agent: str, key: str) -> float:
        profile = self.hellos.get(agent, {}).get("profile")
        return number(profile.get(key)) if isinstance(profile, dict) else 0.0

    def order(self, agents: set[str]) -> list[str]:
        """Fastest link first; between equal links, the faster board (its measured
        step of this job's model once known, else the hello's generic step)."""

        def key(a: str) -> tuple[float, float, str]:
            step = self.step_s.get(a, number(self.hellos.get(a, {}).get("step_s")))
            return -self.link(a), step, a

        return sorted(agents, key=key)

    def round_estimate(self, members: list[str]) -> float:
        """Seconds a ring round should take: the slowest member's step, plus the ring's
        2(N-1) steps of one dense payload's share over the slowest measured link (an
        upper bound: compression only makes the payload smaller)."""
        if not members or not self.numel:
            return 0.0
        n = len(members)
        step = max((self.step_s.get(a, 0.0) for a in members), default=0.0)
        bps = min((b for b in map(self.link, members) if b > 0), default=0.0)
        share = 4 * self.numel * 2 * (n - 1) / n
        return step + (share / bps if bps else 0.0)

    def frame_bytes(self, members: list[str]) -> int:
        """The ring's frame size: the smallest any member's board profile allows
        (0 leaves the default), so every member can take every frame."""
        sizes = [int(self.profile(a, "max_frame_bytes")) for a in members]
        return min((b for b in sizes if b >= 8192), default=0)

    def stall(self, members: list[str], step_timeout_s: float) -> float:
        """How long without progress ends an epoch: the longest of 3 ring-step
        deadlines, 20 estimated rounds, and the slowest member's round deadline.
        Worked out again only when the members, a hello or an ack changed (the members
        list by identity, held here: a segment keeps one; `step_s` changes in `on_ack`)."""
        hellos = self.hellos
        version = hellos.version if isinstance(hellos, Hellos) else None
        key = (len(members), step_timeout_s, version, self._acks, len(self.step_s))
        memo = self._stall
        if memo is not None and version is not None and memo[0] is members and memo[1] == key:
            return memo[2]
        deadline = max((self.profile(a, "round_deadline_s") for a in members), default=0.0)
        value = max(3 * step_timeout_s, 20 * self.round_estimate(members), deadline)
        self._stall = (members, key, value)
        return value

    def machine(self, agent: str) -> str:
        """The CPU architecture the agent announced (``platform.machine()``), "" unknown."""
        value = self.hellos.get(agent, {}).get("machine", "")
        return value if isinstance(value, str) else ""

    def mixed(self, members: list[str]) -> bool:
        """Whether `members` run on more than one CPU architecture (`engine.resync`)."""
        return len({m for m in map(self.machine, members) if m}) > 1

    def cost_probe(self, agent: str) -> Probe:
        """The agent's link and codec as its hello announced them (`collective.cost`);
        an older agent's hello has only `link_bps`, taken for both directions."""
        hello = self.hellos.get(agent, {})
        link = self.link(agent)

        def pair(key: str) -> tuple[float, float]:
            value = hello.get(key)
            if isinstance(value, list | tuple) and len(value) == 2:
                return number(value[0]), number(value[1])
            return 0.0, 0.0

        return Probe(
            rtt_s=number(hello.get("rtt_s")),
            up_bps=number(hello.get("up_bps")) or link,
            down_bps=number(hello.get("down_bps")) or link,
            encode_s=pair("encode_s"), decode_s=pair("decode_s"),
        )  # fmt: skip

    def probes(self, members: list[str]) -> dict[str, dict[str, float | None]]:
        out: dict[str, dict[str, float | None]] = {}
        for a in members:
            probe = self.cost_probe(a)
            out[a] = {"step_s": self.step_s.get(a), "link_bps": self.link(a), "rtt_s": probe.rtt_s,
                      "up_bps": probe.up_bps, "down_bps": probe.down_bps}  # fmt: skip
        return out


# The ring channel's `PeerLost` text, as a member's nack carries it in ``why``.
_PEER_LOST = re.compile(r"peer '([A-Za-z0-9_.-]+)' left or was lost")


def reported_lost(doc: dict[str, Any]) -> str:
    """The peer a member's nack says it lost ("" if none): its ``lost`` field, else the
    channel's `PeerLost` text in ``why``."""
    lost = doc.get("lost")
    if isinstance(lost, str):
        return lost
    found = _PEER_LOST.search(str(doc.get("why", "")))
    return found.group(1) if found else ""


@dataclass
class Suspects:
    """Peers a member reported lost that the coordinator's own link may still see online.

    A report ends the epoch at once (the ring is broken either way), but it does not
    decide the next ring's members: it may be early (the peer is dead and the link's
    watch has not said so yet: a ring re-formed with it stalls until it does) or wrong
    (the reporter's own hiccup). A suspect waits for the link's verdict: it leaves
    (lost), it comes back under a new session (joined: `clear`), or it is still online
    `verdict_s` after the report, which the watch would have noticed were it silent.
    """

    since: dict[str, float] = field(default_factory=dict)  # agent -> first report, monotonic

    def report(self, agent: str, now: float) -> None:
        self.since.setdefault(agent, now)

    def clear(self, agent: str) -> None:
        self.since.pop(agent, None)

    def pending(self, online: Set[str], now: float, verdict_s: Callable[[str], float]) -> set[str]:
        """The suspects whose verdict is not in yet; those decided are forgotten."""
        for agent, at in list(self.since.items()):
            if agent not in online or now - at >= verdict_s(agent):
                del self.since[agent]
        return set(self.since)
