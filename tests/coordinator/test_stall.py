"""`Fleet.stall` kept up to date by single agents' hellos and acks equals working it out
from scratch, whatever order the figures move in."""

from __future__ import annotations

import random
from typing import Any

import pytest

from fedring.coordinator.membership import Fleet, number


def _from_scratch(fleet: Fleet, members: list[str], timeout: float) -> float:
    deadline = max((fleet.profile(a, "round_deadline_s") for a in members), default=0.0)
    estimate = 0.0
    if members and fleet.numel:
        n = len(members)
        step = max((fleet.step_s.get(a, 0.0) for a in members), default=0.0)
        bps = min((b for b in map(fleet.link, members) if b > 0), default=0.0)
        estimate = step + (4 * fleet.numel * 2 * (n - 1) / n / bps if bps else 0.0)
    return max(3 * timeout, 20 * estimate, deadline)


def _hello(rng: random.Random) -> dict[str, Any]:
    link = rng.choice([0, 1e5, 1e6, 5e6, 1e7, "fast", -3])
    return {"link_bps": link, "profile": {"round_deadline_s": rng.choice([0, 5, 50, 400])}}


@pytest.mark.parametrize("seed", range(20))
def test_stall_follows_every_change_exactly(seed: int) -> None:
    rng = random.Random(seed)
    agents = [f"a{i}" for i in range(12)]
    fleet = Fleet(hellos={a: _hello(rng) for a in agents[:8]})
    members = agents[:6]
    for _ in range(300):
        op = rng.random()
        who = rng.choice(agents)
        if op < 0.35:
            fleet.on_ack(who, {"step_s": rng.choice([0.0, 0.01, 0.1, 2.0, 30.0]), "numel": 5000})
        elif op < 0.7:
            fleet.hellos[who] = _hello(rng)
        elif op < 0.8:
            fleet.hellos.pop(who, None)
        elif op < 0.85:
            members = rng.sample(agents, rng.randint(0, len(agents)))  # a new segment
        elif op < 0.9:
            fleet.hellos.update({who: _hello(rng)})
        timeout = rng.choice([1.0, 20.0])
        assert fleet.stall(members, timeout) == _from_scratch(fleet, members, timeout)


def test_a_segment_of_a_thousand_does_not_walk_its_members_per_message() -> None:
    """Once measured, a segment's stall costs no pass over the members: the extremes
    stay put while patches and metrics come in."""
    members = [f"a{i}" for i in range(1000)]
    fleet = Fleet(hellos={a: {"link_bps": 1e6} for a in members})
    for a in members:
        fleet.on_ack(a, {"step_s": 0.01, "numel": 12_740})
    first = fleet.stall(members, 60.0)
    measured = fleet.extremes
    fleet.on_ack("a5", {"step_s": 0.01})  # the same figure again: no pass
    fleet.hellos["a7"] = {"link_bps": 1e6}
    assert fleet.stall(members, 60.0) == first and fleet.extremes is measured
    fleet.hellos["a9"] = {"link_bps": 1e3}  # slower: the estimate grows, still no pass
    assert fleet.stall(members, 60.0) > first and fleet.extremes is measured
    assert number(fleet.extremes.link) == 1e3
