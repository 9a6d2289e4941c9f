"""Keeping every member on the same step, and saying so when one is not.

Every exchange of a `DistributedOptimizer` is tagged with its round (the step in
sync mode, the sync in local mode), and a member only combines frames of its own
round. Two misuses leave members on different rounds, and without these checks the
group just waits until its deadline with no word about why:

- calling the wrapped optimizer's own ``step()`` on one member (it steps alone; the
  group never hears of it). `InnerStepGuard` makes that call raise
  `DirectStepError` at once, on the member that made it;
- members whose round counters differ (a state loaded from another checkpoint, a
  member that skipped or repeated `step`). When a wait times out, the frames that
  peers sent for *other* rounds are the evidence: `StepMismatch` names each such
  peer with the round it is on beside this member's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fedring.collective.channel import CollectiveTimeout, PeerChannel


class DirectStepError(RuntimeError):
    """The optimizer wrapped by a `DistributedOptimizer` was stepped directly."""


class StepMismatch(CollectiveTimeout):
    """A peer's frames are for another round than this member's; names both.

    A `CollectiveTimeout`: raised when this member's wait for a round times out and
    the frames that did arrive are for other rounds (a member that called its inner
    optimizer's ``step()`` or skipped ``opt.step()``), instead of a bare timeout.

    Attributes
    ----------
    member : str
        This member.
    step : int
        The round this member waited on.
    peers : dict of str to int
        Each peer heard from on another round, with that round.
    cause : str
        The timeout's own message, kept at the end of this one.
    """

    def __init__(self, member: str, step: int, peers: dict[str, int], cause: str) -> None:
        on = ", ".join(f"{p!r} is on step {r}" for p, r in sorted(peers.items()))
        super().__init__(
            f"{member!r} is on step {step} but {on}: every member must call "
            "DistributedOptimizer.step() the same number of times (and load state of the "
            f"same round); the wait ended with: {cause}"
        )
        self.member, self.step, self.peers = member, step, peers


class InnerStepGuard:
    """A step pre-hook on the wrapped optimizer that refuses any step not made by the
    distributed optimizer itself (`allowed` is the way in)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._inside = False
        self._handle = optimizer.register_step_pre_hook(self._check)

    def _check(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if not self._inside:
            raise DirectStepError(
                "the optimizer wrapped by DistributedOptimizer was stepped directly: call "
                "DistributedOptimizer.step() (which agrees with the group, then steps it); "
                "a member that steps alone leaves the others waiting for it"
            )

    @contextmanager
    def allowed(self) -> Iterator[None]:
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def remove(self) -> None:
        self._handle.remove()


def diagnosed(exc: CollectiveTimeout, channel: PeerChannel, round: int) -> CollectiveTimeout:
    """`exc`, or a `StepMismatch` if peers' frames waiting here are for other rounds."""
    if isinstance(exc, StepMismatch):
        return exc
    peers = elsewhere(channel, round, waited_on=str(exc))
    return StepMismatch(channel.name, round, peers, str(exc)) if peers else exc


def elsewhere(channel: PeerChannel, round: int, waited_on: str = "") -> dict[str, int]:
    """Peers whose waiting frames are all for rounds other than `round`: peer -> the
    nearest such round.

    A peer one round ahead is often only fast (it finished this round, we wait on
    someone else), so it counts only when `waited_on` (the timeout's text) names it.
    """
    # The channel's stash of checked payloads waiting for their position (src, round,
    # step, phase); read-only here.
    stash: dict[tuple[str, int, int, str], Any] = getattr(channel, "_stash", {})
    rounds: dict[str, set[int]] = {}
    for src, r, _step, _phase in list(stash):
        rounds.setdefault(src, set()).add(r)
    out = {}
    for src, rs in rounds.items():
        if round in rs or src == channel.name:
            continue
        nearest = min(rs, key=lambda r: abs(r - round))
        if nearest != round + 1 or repr(src) in waited_on:
            out[src] = nearest
    return out
