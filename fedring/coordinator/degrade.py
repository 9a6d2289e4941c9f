"""When a ring that keeps breaking goes on asynchronously, and when it comes back.

SEEDS A's exception handling: on a communication interruption, retry
automatically *or degrade to asynchronous updates*. The coordinator re-forms a
broken ring (the retry); a ring re-formed `degrade_after` times, each within
`degrade_window` rounds or `degrade_window_s` seconds of the one before, is taken for
a fleet too unsteady for a ring, and the job goes on as an asynchronous one through
the coordinator (a lost agent is only dropped). Once no agent has come or gone for `degrade_calm`
versions the job returns to the ring from the coordinator's model.

Re-formations at the same round count once: one death is often reported by each
agent it stopped before the broker's last-will arrives, and each report ends an
epoch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fedring.build import degrades
from fedring.config import JobSpec


@dataclass
class Degrade:
    """A ring job's breaks and whether it runs asynchronously now."""

    spec: JobSpec
    breaks: list[int] = field(default_factory=list)  # rounds of the recent re-formations
    last_break_s: float = 0.0  # monotonic time of the latest one
    active: bool = False  # the job runs asynchronously through the coordinator
    times: int = 0  # how often it degraded
    calm_since: int = 0  # the version of the last membership change while active
    returning: bool = False  # the asynchronous epoch is ending: back to the ring

    def broke(self, at_round: int, now: float | None = None) -> str:
        """A ring epoch ended in a re-formation at `at_round` (at monotonic time `now`);
        returns why the job goes asynchronous now, or "" while it stays on the ring."""
        spec = self.spec
        if not degrades(spec) or self.active or (self.breaks and at_round == self.breaks[-1]):
            return ""
        now = time.monotonic() if now is None else now
        near = at_round - self.breaks[-1] <= spec.degrade_window if self.breaks else True
        soon = spec.degrade_window_s > 0 and now - self.last_break_s <= spec.degrade_window_s
        if self.breaks and not (near or soon):
            self.breaks.clear()
        self.breaks.append(at_round)
        self.last_break_s = now
        if len(self.breaks) < spec.degrade_after:
            return ""
        seconds = f" or {spec.degrade_window_s:g} s" if spec.degrade_window_s > 0 else ""
        why = (f"the ring broke {len(self.breaks)} times (rounds {self.breaks}), each within "
               f"{spec.degrade_window} rounds{seconds} of the last: going on asynchronously "
               "through the coordinator")  # fmt: skip
        self.active, self.times, self.calm_since = True, self.times + 1, at_round
        self.breaks.clear()
        return why

    def moved(self, version: int) -> None:
        """An agent came or went: the fleet is not calm yet."""
        if self.active:
            self.calm_since = version

    def calm(self, version: int) -> bool:
        """True once, when the asynchronous epoch should end for calm at `version`."""
        if not self.active or self.returning or version >= self.spec.rounds:
            return False
        self.returning = version - self.calm_since >= self.spec.degrade_calm
        return self.returning

    def back(self, version: int) -> str:
        """The asynchronous epoch ended for calm: back on the ring; says so."""
        self.active = self.returning = False
        return (f"no agent came or went for {self.spec.degrade_calm} versions: back to the "
                f"ring from round {version}")  # fmt: skip
