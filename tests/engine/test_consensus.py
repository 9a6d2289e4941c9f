"""A star's consensus support (`compression.support`, `engine.centre`): the sampled
members vote, every one of them sends its values on the support the votes chose,
error feedback keeps what was not on it, a member that sits out takes only the
reply, and the robust rules on a short digits star stay near the mean."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from fedring.aggregation.rules import median
from fedring.collective.channel import PeerChannel
from fedring.collective.payloads import decode_payload, encode_payload
from fedring.compression.payload import PayloadLimits
from fedring.compression.support import (
    GroupIndices,
    at_support,
    choose_support,
    scatter,
    top_indices,
)
from fedring.config import JobSpec
from fedring.engine.attack import Attack
from fedring.engine.centre import STAR, CentreSettings, serve
from fedring.engine.group import LOCAL_KEY, local_group
from fedring.engine.participation import sampled
from fedring.engine.reducer import Reducer, ReducerSettings
from fedring.engine.star import Centre
from fedring.sim.runner import simulate
from fedring.transport.base import Deadline
from fedring.transport.inproc import InprocTransport
from fedring.wire.errors import FrameError

D, G, K = 16, 8, 2  # two groups of 8, two entries a group


def _round_trip(p: GroupIndices) -> GroupIndices:
    meta, body = encode_payload(p)
    got = decode_payload(meta, bytearray(body), PayloadLimits(max_numel=D))
    assert isinstance(got, GroupIndices)
    return got


def test_a_support_travels_as_one_byte_an_index() -> None:
    s = GroupIndices.of(torch.tensor([[1, 5], [0, 3]]), numel=D, group_size=G)
    got = _round_trip(s)
    assert got.indices.tolist() == [[1, 5], [0, 3]] and s.wire_nbytes == 4
    assert got.decompress().nonzero().reshape(-1).tolist() == [1, 5, 8, 11]


@pytest.mark.parametrize(("idx", "reason"), [([[1, 1], [0, 3]], "repeats"),
                                            ([[1, 9], [0, 3]], ">= group size")])  # fmt: skip
def test_a_vote_twice_for_one_entry_or_outside_its_group_is_refused(idx: Any, reason: str) -> None:
    meta, body = encode_payload(GroupIndices(D, G, torch.tensor(idx)))
    with pytest.raises(FrameError, match=reason):
        decode_payload(meta, bytearray(body), PayloadLimits(max_numel=D))


def test_the_most_voted_entries_make_the_support_ties_drawn_by_the_seed() -> None:
    tally = torch.zeros(D)
    tally[[2, 6, 7, 12]] = torch.tensor([3.0, 1.0, 2.0, 3.0])
    s = choose_support(tally, group_size=G, k=K, seed=0)
    assert sorted(s.indices[0].tolist()) == [2, 7]  # 3 and 2 votes beat 1
    assert 4 in s.indices[1].tolist()  # entry 12 is group 1's index 4
    draws = {tuple(sorted(choose_support(tally, group_size=G, k=K, seed=i).indices[1].tolist()))
             for i in range(20)}  # fmt: skip
    assert len(draws) > 1  # the second of group 1 is a seeded draw among the ties
    # the padded tail of a last group is never chosen while real entries are left
    short = choose_support(torch.zeros(10), group_size=G, k=K, seed=1)
    assert bool((short.indices[1] < 2).all())


def test_values_on_a_support_are_what_error_feedback_subtracts() -> None:
    g = torch.arange(D, dtype=torch.float32) / 3
    s = GroupIndices.of(torch.tensor([[1, 5], [0, 3]]), numel=D, group_size=G)
    sent = at_support(g, s, "fp16")
    rest = g - sent.decompress()
    assert torch.equal(rest + sent.decompress(), g)  # bit for bit
    assert torch.equal(rest[[1, 5, 8, 11]], torch.zeros(4)) or bool(
        (rest[[1, 5, 8, 11]].abs() < 1e-3).all()  # fp16 rounding stays in the residual
    )
    assert top_indices(rest, group_size=G, k=K).indices.shape == (2, K)


@dataclass(frozen=True)
class _Counting(Centre):
    """A member's link that notes the rounds whose support it took, and adds up
    what it sent on them."""

    taken: list[int] = field(default_factory=list)
    supports: list[GroupIndices] = field(default_factory=list)
    sent: torch.Tensor = field(default_factory=lambda: torch.zeros(D))

    def support(self, *, round: int, numel: int, deadline: Deadline) -> GroupIndices:
        self.taken.append(round)
        self.supports.append(super().support(round=round, numel=numel, deadline=deadline))
        return self.supports[-1]

    def exchange_on(self, values: Any, *, round: int, numel: int, deadline: Deadline) -> Any:
        self.sent.add_(scatter(values.values, self.supports[-1]))
        return super().exchange_on(values, round=round, numel=numel, deadline=deadline)


def _star(n: int, rounds: int, vecs: list[torch.Tensor], *, sample: float = 1.0,
          rule: str = "median") -> tuple[list[list[torch.Tensor]], list[Reducer]]:  # fmt: skip
    """`n` members with consensus reducers through a served centre for `rounds`;
    member i hands ``vecs[i]`` every round it is sampled. Their replies and reducers."""
    hub = InprocTransport()
    groups = local_group(n, hub=hub, timeout_s=10.0)
    settings = ReducerSettings(density=K / G, group_size=G, value_dtype="fp32", consensus=True)
    reducers = [Reducer(gr.collective, D, settings, centre=_Counting(gr.collective.channel))
                for gr in groups]  # fmt: skip
    centre = PeerChannel(hub.connect(STAR), "local", key=LOCAL_KEY)
    served: list[int] = []
    cs = CentreSettings(rule, rounds=rounds, timeout_s=10.0, sample=sample, seed=5,
                        consensus=True, group_size=G)  # fmt: skip
    threads = [threading.Thread(target=lambda: served.append(serve(centre, groups[0].members, D,
                                                                   cs)), daemon=True)]  # fmt: skip
    replies: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def member(i: int) -> None:
        for r in range(rounds):
            if i in sampled(5, r, n, sample):
                replies[i].append(reducers[i].star(vecs[i], round=r))
            else:
                replies[i].append(reducers[i].star_result(round=r))

    threads += [threading.Thread(target=member, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert served == [rounds] and all(len(rs) == rounds for rs in replies)
    # a member takes the support of the rounds it is sampled for, and only those
    for i, red in enumerate(reducers):
        want = [r for r in range(rounds) if i in sampled(5, r, n, sample)]
        assert red.centre.taken == want  # type: ignore[union-attr]
    return replies, reducers


def test_members_send_on_the_support_and_error_feedback_keeps_the_rest() -> None:
    """The members agree that entries 1, 5 (group 0) and 8, 12 (group 1) matter most:
    each round takes the median of their values there, and each residual keeps all
    the rest."""
    base = torch.full((D,), 0.01)
    base[[1, 5, 8, 12]] = torch.tensor([1.0, -2.0, 3.0, -4.0])
    vecs = [base * (i + 1) for i in range(3)]
    replies, reducers = _star(3, 2, vecs)
    on = [1, 5, 8, 12]
    want = torch.zeros(D)
    want[on] = median(torch.stack([v[on] for v in vecs]))
    for i, red in enumerate(reducers):
        assert red.ef is not None
        kept = 2 * vecs[i]  # two rounds handed over
        kept[on] = 0.0  # ... less what was sent on the support, both rounds
        assert torch.equal(red.ef.residual, kept)
        assert all(torch.allclose(reply, want, atol=1e-3) for reply in replies[i])  # fp16
        assert all(torch.equal(reply, r0) for reply, r0 in zip(replies[i], replies[0],
                                                               strict=True))  # fmt: skip


def test_a_member_that_sits_out_takes_only_the_same_result() -> None:
    vecs = [torch.randn(D, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    replies, reducers = _star(4, 6, vecs, sample=0.5, rule="clip")
    for r in range(6):
        assert all(torch.equal(rs[r], replies[0][r]) for rs in replies)
        assert bool(replies[0][r].any())
    for i, red in enumerate(reducers):  # whatever was handed over and not sent is kept
        trained = sum(i in sampled(5, r, 4, 0.5) for r in range(6))
        assert red.ef is not None and isinstance(red.centre, _Counting)
        assert torch.allclose(red.ef.residual + red.centre.sent, trained * vecs[i], atol=1e-6)


SPEC = JobSpec(agents=4, dataset="digits", topology="star", rounds=120, density=0.01, seed=0)


@pytest.fixture(scope="module")
def mean_acc() -> float:
    return float(simulate(SPEC)["final_accuracy"])


@pytest.mark.parametrize("rule", ["median", "trimmed:0.25", "clip"])
def test_the_robust_rules_stay_near_the_mean_at_one_percent(rule: str, mean_acc: float) -> None:
    got = simulate(SPEC.replace(aggregation=rule))
    assert got["identical_models"]
    assert got["final_accuracy"] > mean_acc - 0.03, (rule, mean_acc)


@pytest.mark.parametrize("rule", ["mean", "median", "clip"])
def test_one_attacker_of_four_breaks_the_mean_not_the_robust_rules(
    rule: str, mean_acc: float
) -> None:
    """`engine.attack`'s scale:-10 (a sign flip ten times as large) from the last rank."""
    got = simulate(SPEC.replace(aggregation=rule), attack=Attack.parse("scale:-10"), attackers=1)
    assert got["attack"]["attack_updates"] == SPEC.rounds
    if rule == "mean":
        assert got["final_accuracy"] < 0.5
    else:
        assert got["final_accuracy"] > mean_acc - 0.03, (rule, mean_acc)


def test_a_sampled_clip_star_runs_on_the_support_and_the_members_stay_identical() -> None:
    spec = SPEC.replace(agents=6, rounds=40, aggregation="clip", sample=0.5)
    got = simulate(spec)
    assert got["identical_models"] and [row["trained"] for row in got["rows"]] == [3] * 40
    assert got["final_accuracy"] > 0.7
