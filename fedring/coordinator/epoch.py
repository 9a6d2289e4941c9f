"""The coordinator's decisions about one epoch, apart from its link and its files.

An epoch is one ring (its members, in order) running from one round until it is done
or must re-form. What the coordinator decides about it is here, as plain state and
functions of plain values: who forms the next ring (`next_ring`), whether a member's
event or nack ends the epoch or an asynchronous job only goes on without it
(`on_member`, `on_nack`), when the epoch is done (`Epoch.finished`), where a re-plan
resumes (`held_round`), whether the ring broke, re-planned, finished or comes back
from asynchronous (`outcome`, `async_ended`), and whether members' model hashes agree
(`hashes_agree`). `coordinator.service` reads the broker, calls these, and acts:
it sends, halts, checkpoints and writes. When a ring goes asynchronous and back is
`coordinator.degrade`; which peers are suspects, `coordinator.membership`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fedring.coordinator.membership import Fleet, reported_lost

# Rounds between the first and last member to halt that a re-plan resumes across: an
# agent keeps its last 4 rounds' states (`edge_agent.worker`), a synchronous ring
# halts within one round.
HELD_SPREAD = 2


@dataclass
class Epoch:
    number: int
    members: list[str]  # in ring order: the head first
    start: int
    acks: set[str] = field(default_factory=set)
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # member -> its bye
    gone: set[str] = field(default_factory=set)  # an asynchronous job goes on without them
    held: str = ""  # sha256 of the state at `start` every member holds (no model sent)
    halted: dict[str, tuple[int, str]] = field(default_factory=dict)  # round, sha256 at halt
    stopped: set[str] = field(default_factory=set)  # nacked: its segment ended, no halt to await
    barrier: bool = False  # a broadcast collective: round 0 waits for the go (every ack)
    _unacked: tuple[int, list[str]] | None = field(default=None, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        """Every member said bye, or went (an asynchronous job), and one at least said it."""
        if len(self.done) + len(self.gone) < len(self.members):
            return False  # asked after every message: no sets while the byes come in
        return bool(self.done) and set(self.members) <= set(self.done) | self.gone

    def unacked(self) -> list[str]:
        """The members that have not acknowledged their manifest, sorted. The segment's
        loop asks after every control message: worked out again only when an ack came
        (acks only grow), not N^2 a round for a thousand members."""
        memo, acked = self._unacked, len(self.acks)
        if memo is None or acked < memo[0]:
            self._unacked = (acked, sorted(set(self.members) - self.acks))
        elif acked != memo[0]:  # the last answer, filtered, is still sorted: no sort
            self._unacked = (acked, [m for m in memo[1] if m not in self.acks])
        return list(self._unacked[1]) if self._unacked else []

    def went(self, who: str) -> bool:
        """An asynchronous job goes on without `who`; True the first time only."""
        if who in self.gone:
            return False
        self.gone.add(who)
        return True


@dataclass(frozen=True)
class Verdict:
    """What an event means for the epoch: `reform` ends it (why); `drop`: an asynchronous
    job goes on without the member (why, after its name); both "": nothing. `lost`: a
    member was lost or left (counted either way)."""

    reform: str = ""
    drop: str = ""
    lost: bool = False


def on_member(ep: Epoch, holders: Collection[str], who: str, kind: str,
              asynchronous: bool) -> Verdict:  # fmt: skip
    """A presence event (`kind`: joined, lost, left) of `who`; `holders` hold a shard.

    A member lost ends a ring's epoch; an asynchronous job only drops it (its members
    are fixed for the epoch, the centre skips the lost). A holder that comes back ends
    a ring's epoch so that the next ring has it again.
    """
    if who in ep.members and kind in ("lost", "left"):
        if asynchronous:
            return Verdict(drop=kind, lost=True)
        return Verdict(reform=f"{who} {kind}", lost=True)
    if not asynchronous and kind == "joined" and who in holders and who not in ep.members:
        return Verdict(reform=f"{who} came back")
    return Verdict()


def on_nack(src: str, why: str, asynchronous: bool) -> Verdict:
    """A member stopped (its nack says `why`): a ring re-forms, an asynchronous job goes
    on without it."""
    if asynchronous:
        return Verdict(drop=f"stopped: {why}")
    return Verdict(reform=f"{src} stopped: {why}")


def nack_report(src: str, doc: Mapping[str, Any]) -> tuple[str, str]:
    """What a nack says beyond "stopped": (why `src` refused the job for good or "",
    the peer it lost or ""); a member never suspects itself."""
    why = str(doc.get("why", ""))
    peer = reported_lost(dict(doc))
    return (why if why.startswith("refused") else ""), (peer if peer != src else "")


def next_ring(fleet: Fleet, ready: Collection[str], holders: Collection[str],
              refused: Collection[str]) -> list[str]:  # fmt: skip
    """The next ring, in order: agents ready (hello and online) that hold a shard and did
    not refuse the job; suspects are already decided (`Suspects.pending`)."""
    return fleet.order((set(ready) & set(holders)) - set(refused))


def shortfall(members: Collection[str], want: int, refused: Mapping[str, str]) -> str:
    """Why the job stops when refusals left fewer than `want` members, or "" (a lost
    agent may come back; a refusal -- task, shard, memory -- is for good)."""
    if not refused or len(members) >= want:
        return ""
    why = "; ".join(f"{a}: {w}" for a, w in sorted(refused.items()))
    return (f"{len(members)} of the {want} agents the job needs are left after "
            f"{len(refused)} refused it ({why}); fix those agents, or lower "
            "--min-agents to run with fewer")  # fmt: skip


def same_order(members: list[str], before: list[str]) -> list[str]:
    """`members` in the order of the ring `before` when they are the same agents: a
    re-plan re-forms the same ring. The fleet's order (`Fleet.order`) moves as the
    members' measured steps arrive with their first acks, and a ring in another order
    is another ring to `held_round` and the plans (`CollectivePlans`): the job would go
    back to its last checkpoint (round 0 in a job that saves only at the end) and the
    plan measured on these members would be forgotten."""
    return list(before) if set(members) == set(before) and len(members) == len(before) else members


def held_round(ep: Epoch, members: list[str], spread: int = HELD_SPREAD) -> tuple[int, str] | None:
    """The newest round every member of the halted `ep` still holds, and its state's
    sha256, when the same `members` all halted within `spread` rounds and agree on it."""
    if members != ep.members or set(ep.halted) != set(members):
        return None
    rounds = [r for r, _ in ep.halted.values()]
    start = min(rounds)
    hashes = {sha for r, sha in ep.halted.values() if r == start}
    if max(rounds) - start > spread or len(hashes) != 1 or "" in hashes:
        return None
    return start, hashes.pop()


Outcome = Literal["finish", "back", "replan", "break"]


def outcome(done: bool, returning: bool, replanning: bool) -> Outcome:
    """How an epoch ended: the job is done (`finish`); a degraded epoch ended for calm
    (`back`: to the ring, unless it finished after all, `async_ended`); `auto` re-plans
    (`replan`: not a break of the ring); anything else is a `break` (`Degrade.broke`)."""
    if done:
        return "back" if returning else "finish"
    return "replan" if replanning else "break"


def async_ended(version: int, rounds: int, target: float, accuracy: float) -> bool:
    """Whether an asynchronous epoch that ended at `version` finished the job."""
    return version >= rounds or bool(target and accuracy >= target)


def hashes_agree(seen: Mapping[str, str], resynced: bool, machine: Callable[[str], str]) -> bool:
    """Members' model hashes of one round (agent -> sha256): equal across the fleet at a
    re-sync round, else equal within each CPU architecture (`engine.resync`)."""
    if len(set(seen.values())) == 1:  # asked at every member's row: C speed, no lookups
        return True
    if resynced:
        return False
    classes: dict[str, set[str]] = {}
    for agent, sha in seen.items():
        classes.setdefault(machine(agent), set()).add(sha)
    return all(len(shas) == 1 for shas in classes.values())
