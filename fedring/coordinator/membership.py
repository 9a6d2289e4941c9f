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
from dataclasses import dataclass, field, replace
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
    """Agent -> its hello; a write tells the `Fleet` that owns it, which keeps the
    extremes `Fleet.stall` reads up to date (`Extremes`)."""

    owner: Fleet | None = None

    def __setitem__(self, agent: str, hello: dict[str, Any]) -> None:
        before = self.owner.figures(agent) if self.owner else None
        super().__setitem__(agent, hello)
        if self.owner and before:
            self.owner.moved(agent, before)

    def __delitem__(self, agent: str) -> None:
        before = self.owner.figures(agent) if self.owner else None
        super().__delitem__(agent)
        if self.owner and before:
            self.owner.moved(agent, before)

    def pop(self, agent: str, *default: Any) -> Any:
        before = self.owner.figures(agent) if self.owner else None
        found = super().pop(agent, *default)
        if self.owner and before:
            self.owner.moved(agent, before)
        return found

    def _stale(self) -> None:
        if self.owner and self.owner.extremes:
            self.owner.extremes.stale = True

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._stale()

    def setdefault(self, agent: str, hello: Any = None) -> Any:
        self._stale()
        return super().setdefault(agent, hello)

    def popitem(self) -> tuple[str, dict[str, Any]]:
        self._stale()
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self._stale()


Figures = tuple[float, float, float]  # an agent's step, link (0: unknown), round deadline


@dataclass
class Extremes:
    """Over one segment's members: the slowest step, the slowest known link (inf: none)
    and the longest round deadline. The segment's loop asks for `Fleet.stall` after every
    control message; a full pass is O(N), so N^2 a round (a thousand members' patches)
    and N^2 at enrolment (their acks, each changing one step): kept up to date as one
    agent's figures move instead, and worked out again only when an extreme one got
    less extreme (`stale`)."""

    members: list[str]  # held by identity: a segment keeps its list as it is
    size: int  # len(members) when measured
    names: frozenset[str]
    step: float
    link: float
    deadline: float
    stale: bool = False

    def move(self, before: Figures, after: Figures) -> None:
        (s0, l0, d0), (s1, l1, d1) = before, after
        l0, l1 = (x if x > 0 else math.inf for x in (l0, l1))
        if s1 >= self.step:
            self.step = s1
        elif s0 == self.step:
            self.stale = True
        if d1 >= self.deadline:
            self.deadline = d1
        elif d0 == self.deadline:
            self.stale = True
        if l1 <= self.link:
            self.link = l1
        elif l0 == self.link:
            self.stale = True


@dataclass
class Fleet:
    hellos: dict[str, dict[str, Any]] = field(default_factory=Hellos)  # agent -> its hello
    step_s: dict[str, float] = field(default_factory=dict)  # a step of the job's model
    numel: int = 0  # parameters of the job's model, from the first ack
    extremes: Extremes | None = field(default=None, repr=False)  # what `stall` reads

    def __post_init__(self) -> None:
        if not isinstance(self.hellos, Hellos):
            self.hellos = Hellos(self.hellos)
        self.hellos.owner = self

    def on_ack(self, agent: str, doc: dict[str, Any]) -> None:
        if "step_s" in doc:
            before = self.figures(agent)
            self.step_s[agent] = number(doc["step_s"])
            self.moved(agent, before)
        self.numel = self.numel or int(number(doc.get("numel", 0)))

    def figures(self, agent: str) -> Figures:
        deadline = self.profile(agent, "round_deadline_s")
        return self.step_s.get(agent, 0.0), self.link(agent), deadline

    def moved(self, agent: str, before: Figures) -> None:
        """`agent`'s hello or step changed (it had `before`): keep the extremes current."""
        if self.extremes is not None and agent in self.extremes.names:
            self.extremes.move(before, self.figures(agent))

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
        deadlines, 20 estimated rounds, and the slowest member's round deadline
        (`round_estimate`, from the members' `Extremes`: O(1) while they stay put)."""
        ex = self.extremes
        owned = isinstance(self.hellos, Hellos) and self.hellos.owner is self
        if (not owned or ex is None or ex.stale or ex.members is not members
                or ex.size != len(members)):  # fmt: skip
            figures = [self.figures(a) for a in members]
            ex = Extremes(members, len(members), frozenset(members),
                          max((f[0] for f in figures), default=0.0),
                          min((f[1] for f in figures if f[1] > 0), default=math.inf),
                          max((f[2] for f in figures), default=0.0))  # fmt: skip
            self.extremes = ex if owned else None
        estimate = 0.0
        if members and self.numel:
            n = len(members)
            share = 4 * self.numel * 2 * (n - 1) / n
            estimate = ex.step + (share / ex.link if ex.link < math.inf else 0.0)
        return max(3 * step_timeout_s, 20 * estimate, ex.deadline)

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

    def cost_probes(self, members: list[str]) -> list[Probe]:
        """Each member's `cost_probe`, with the cores it shares (`Probe.share`): the
        members whose hellos name the same ``host`` over that host's ``cores`` (the
        fewest any of them announced), at least 1. A member without both is alone."""
        hosts: dict[str, list[str]] = {}
        for a in members:
            host = self.hellos.get(a, {}).get("host")
            if isinstance(host, str) and host and number(self.hellos[a].get("cores")) >= 1:
                hosts.setdefault(host, []).append(a)
        share: dict[str, float] = {}
        for together in hosts.values():
            cores = min(number(self.hellos[a].get("cores")) for a in together)
            share |= dict.fromkeys(together, max(1.0, len(together) / cores))
        return [replace(self.cost_probe(a), share=share.get(a, 1.0)) for a in members]

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
