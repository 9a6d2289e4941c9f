"""The coordinator's decisions about an epoch, called with plain values (no broker, no
link): who forms the next ring, what an event or nack means, when an epoch is done,
where a re-plan resumes, how an epoch ended (`coordinator.epoch`)."""

from __future__ import annotations

import pytest

from fedring.coordinator.epoch import (
    Epoch,
    Verdict,
    async_ended,
    hashes_agree,
    held_round,
    nack_report,
    next_ring,
    on_member,
    on_nack,
    outcome,
    same_order,
    shortfall,
)
from fedring.coordinator.membership import Fleet, Suspects

RING = ["a0", "a1", "a2"]
HOLDERS = {"a0": 0, "a1": 1, "a2": 2, "a3": 3}


# -- who forms the next ring ----------------------------------------------------------


def test_the_next_ring_is_ready_holders_that_did_not_refuse_fastest_first() -> None:
    fleet = Fleet(hellos={"a0": {"link_bps": 1e6}, "a1": {"link_bps": 9e6},
                          "a3": {"link_bps": 5e6}, "guest": {"link_bps": 1e9}})  # fmt: skip
    ready = {"a0", "a1", "a3", "guest"}  # guest holds no shard; a2 is not online
    assert next_ring(fleet, ready, HOLDERS, refused={}) == ["a1", "a3", "a0"]
    assert next_ring(fleet, ready, HOLDERS, refused={"a3": "refused: memory"}) == ["a1", "a0"]


def test_a_suspect_stays_out_of_the_ring_until_the_links_verdict() -> None:
    """A member's report of a lost peer decides nothing until the link agrees (it left),
    the peer came back (a new session clears it), or the verdict time passed."""
    suspects = Suspects()
    _refusal, peer = nack_report("a1", {"why": "peer 'a2' left or was lost"})
    suspects.report(peer, now=10.0)
    online = {"a0", "a1", "a2"}
    assert suspects.pending(online, 11.0, lambda _a: 5.0) == {"a2"}  # undecided: wait
    assert suspects.pending(online, 15.0, lambda _a: 5.0) == set()  # still beating: a member
    suspects.report("a2", 20.0)
    assert suspects.pending(online - {"a2"}, 20.5, lambda _a: 5.0) == set()  # gone: decided


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"why": "refused: module 'x' is not allowed"}, ("refused: module 'x' is not allowed", "")),
        ({"why": "peer 'a2' left or was lost"}, ("", "a2")),
        ({"why": "timeout", "lost": "a0"}, ("", "a0")),
        ({"why": "peer 'a1' left or was lost"}, ("", "")),  # never itself
        ({"why": "error: out of memory"}, ("", "")),
        ({}, ("", "")),
    ],
)
def test_what_a_nack_reports(doc: dict[str, str], expected: tuple[str, str]) -> None:
    assert nack_report("a1", doc) == expected


def test_refusals_below_the_minimum_stop_the_job_and_name_every_refusal() -> None:
    refused = {"a3": "refused: no such task", "a2": "refused: out of memory"}
    why = shortfall(["a0", "a1"], 4, refused)
    assert why.startswith("2 of the 4 agents the job needs are left after 2 refused it")
    assert why.index("a2: refused") < why.index("a3: refused")
    assert shortfall(["a0", "a1"], 2, refused) == ""  # enough left
    assert shortfall(["a0"], 4, {}) == ""  # lost agents may come back: not a refusal


# -- what an event means ----------------------------------------------------------------


def test_a_member_lost_re_forms_a_ring_and_is_dropped_by_an_asynchronous_job() -> None:
    ep = Epoch(0, list(RING), 5)
    assert on_member(ep, HOLDERS, "a1", "lost", False) == Verdict(reform="a1 lost", lost=True)
    assert on_member(ep, HOLDERS, "a1", "left", True) == Verdict(drop="left", lost=True)
    assert on_member(ep, HOLDERS, "a3", "lost", False) == Verdict()  # not a member


def test_a_holder_that_comes_back_re_forms_a_ring_only() -> None:
    ep = Epoch(0, list(RING), 5)
    assert on_member(ep, HOLDERS, "a3", "joined", False) == Verdict(reform="a3 came back")
    assert on_member(ep, HOLDERS, "a3", "joined", True) == Verdict()  # members fixed
    assert on_member(ep, HOLDERS, "a1", "joined", False) == Verdict()  # already in it
    assert on_member(ep, HOLDERS, "guest", "joined", False) == Verdict()  # holds no shard


def test_a_nack_re_forms_a_ring_and_drops_the_member_of_an_asynchronous_job() -> None:
    assert on_nack("a2", "timeout", False) == Verdict(reform="a2 stopped: timeout")
    assert on_nack("a2", "timeout", True) == Verdict(drop="stopped: timeout")


def test_went_is_said_once() -> None:
    ep = Epoch(0, list(RING), 0)
    assert ep.went("a1") and not ep.went("a1") and ep.gone == {"a1"}


# -- when an epoch is done --------------------------------------------------------------


def test_an_epoch_is_done_when_every_member_said_bye_or_went() -> None:
    ep = Epoch(0, list(RING), 0)
    assert not ep.finished
    ep.gone = {"a0", "a1", "a2"}
    assert not ep.finished  # nobody finished the job: every member went
    ep.done["a2"] = {"sha256": "x"}
    assert ep.finished
    ep.gone = {"a1"}
    assert not ep.finished  # a0 has not said bye


def test_the_members_without_an_ack() -> None:
    ep = Epoch(0, list(RING), 0, acks={"a1"})
    assert ep.unacked() == ["a0", "a2"]
    ep.acks |= {"a0", "a2"}
    assert ep.unacked() == []


# -- where a re-plan resumes ------------------------------------------------------------


def _halted(**rounds: tuple[int, str]) -> Epoch:
    return Epoch(3, list(rounds), 0, halted=dict(rounds))


def test_a_re_plan_keeps_the_halted_rings_order_so_its_held_round_counts() -> None:
    ep = _halted(a0=(30, "s"), a1=(30, "s"), a2=(30, "s"))
    moved = ["a2", "a0", "a1"]  # the fleet's order after the members' acks came in
    assert held_round(ep, moved) is None  # another ring: it would go back to the checkpoint
    kept = same_order(moved, ep.members)
    assert kept == ep.members and held_round(ep, kept) == (30, "s")
    assert same_order(["a2", "a0"], ep.members) == ["a2", "a0"]  # fewer: a new ring
    assert same_order(["a3", "a0", "a1"], ep.members) == ["a3", "a0", "a1"]


def test_a_re_plan_resumes_at_the_oldest_round_every_member_holds() -> None:
    ep = _halted(a0=(31, "s31"), a1=(30, "s30"), a2=(32, "s32"))
    assert held_round(ep, ["a0", "a1", "a2"], spread=2) == (30, "s30")


@pytest.mark.parametrize(
    ("members", "halted"),
    [
        (["a0", "a2", "a1"], {"a0": (30, "s"), "a1": (30, "s"), "a2": (30, "s")}),  # order
        (["a0", "a1", "a2"], {"a0": (30, "s"), "a1": (30, "s")}),  # a2 did not say
        (["a0", "a1", "a2"], {"a0": (30, "s"), "a1": (33, "t"), "a2": (30, "s")}),  # spread
        (["a0", "a1", "a2"], {"a0": (30, "s"), "a1": (30, "t"), "a2": (31, "u")}),  # disagree
        (["a0", "a1", "a2"], {"a0": (30, ""), "a1": (30, ""), "a2": (30, "")}),  # none held
    ],
)
def test_no_held_round_rolls_back_to_the_checkpoint(
    members: list[str], halted: dict[str, tuple[int, str]]
) -> None:
    ep = Epoch(3, ["a0", "a1", "a2"], 0, halted=halted)
    assert held_round(ep, members, spread=2) is None


# -- how an epoch ended -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("done", "returning", "replanning", "expected"),
    [
        (True, False, False, "finish"),
        (True, True, False, "back"),
        (False, False, True, "replan"),
        (False, False, False, "break"),
        (False, True, False, "break"),  # a degraded epoch cut short: still a break
    ],
)
def test_how_an_epoch_ended(done: bool, returning: bool, replanning: bool, expected: str) -> None:
    assert outcome(done, returning, replanning) == expected


def test_an_asynchronous_epoch_ends_the_job_at_its_rounds_or_the_target() -> None:
    assert async_ended(100, 100, 0.0, 0.1)
    assert not async_ended(60, 100, 0.0, 0.99)  # no target: only the rounds
    assert async_ended(60, 100, 0.9, 0.95) and not async_ended(60, 100, 0.9, 0.85)


# -- whether the members agree ------------------------------------------------------------


def test_hashes_agree_within_an_architecture_and_across_at_a_re_sync() -> None:
    machines = {"a0": "x86_64", "a1": "x86_64", "a2": "aarch64"}
    machine = machines.__getitem__
    mixed = {"a0": "h1", "a1": "h1", "a2": "h2"}  # the architectures round differently
    assert hashes_agree(mixed, resynced=False, machine=machine)
    assert not hashes_agree(mixed, resynced=True, machine=machine)  # the head's, everywhere
    assert hashes_agree(dict.fromkeys(machines, "h"), resynced=True, machine=machine)
    assert not hashes_agree({"a0": "h1", "a1": "h3"}, resynced=False, machine=machine)
